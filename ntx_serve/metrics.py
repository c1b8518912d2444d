"""Server counters and gauges, rendered in the Prometheus text exposition format (v0.0.4)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Mapping


class Metrics:
    """Updated by the request handlers and the worker thread; read by `/metrics`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.queue_depth = 0
        self.busy = 0
        self.last: dict[str, float] = {}  # numbers of the last finished generation
        self.run_stats: Mapping[str, Any] = {}  # the engine's last_run_stats, when it keeps one

    def count_request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self, name, getattr(self, name) + d)

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []
            _family(lines, "ntx_requests_total", "counter", "Requests by endpoint and outcome.",
                    [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(self.requests.items())])
            _family(lines, "ntx_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, self.prompt_tokens)])
            _family(lines, "ntx_generated_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)])
            _family(lines, "ntx_queue_depth", "gauge", "Requests waiting for the worker.", [({}, self.queue_depth)])
            _family(lines, "ntx_busy", "gauge", "1 while the worker is generating.", [({}, self.busy)])
            for key, help_ in (("prefill_tok_s", "Prefill tokens/s of the last request."),
                               ("decode_tok_s", "Decode tokens/s of the last request.")):
                if key in self.last:
                    _family(lines, f"ntx_last_{key}", "gauge", help_, [({}, self.last[key])])
            self._render_run_stats(lines)
            return "\n".join(lines) + "\n"

    def _render_run_stats(self, lines: list[str]) -> None:
        st = self.run_stats
        tiers = st.get("bytes_per_tier")
        if isinstance(tiers, Mapping):
            _family(lines, "ntx_bytes_per_tier", "gauge", "Weight bytes per tier in the last run's plan.",
                    [({"tier": str(k)}, v) for k, v in tiers.items() if _is_number(v)])
        bw = st.get("bandwidth")
        if isinstance(bw, Mapping):
            _family(lines, "ntx_bandwidth_gb_s", "gauge", "Measured link bandwidth (GB/s).",
                    [({"link": str(k)}, v) for k, v in bw.items() if _is_number(v)])
        if _is_number(st.get("bound_tok_s")):
            _family(lines, "ntx_bound_tok_s", "gauge", "Decode bound from bytes per tier / bandwidth.",
                    [({}, st["bound_tok_s"])])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _family(lines: list[str], name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{lab}}} {_value(value)}" if lab else f"{name} {_value(value)}")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))
