"""The tokenizer stored in a GGUF file, rebuilt to give llama.cpp's token ids.

Two vocabulary types:
- `gpt2`: byte-level BPE. A HF `tokenizers` BPE model runs the merges; the pre-tokenizer is
  the chain of regex splits llama.cpp uses for the file's `tokenizer.ggml.pre`.
- `llama`: SentencePiece-style BPE (Llama-2, Mistral). Adjacent pieces merge by vocabulary
  score, characters outside the vocabulary fall back to `<0xXX>` byte tokens.

Special (control, user-defined, unknown) tokens are cut out of the text before either model
runs, longest text first, exactly as llama.cpp partitions it. Decoding works on bytes: a
token may end in the middle of a UTF-8 character, so `StreamDecoder` only emits complete ones.
"""

from __future__ import annotations

import codecs
import heapq
import re
from operator import add, methodcaller
from enum import IntEnum
from typing import Any, Mapping, Sequence

import numpy as np

from ntx_common.errors import TokenizerError
from ntx_engine.vocab_rules import ALWAYS_RENDERED, EOG_TEXTS, FIM_EOG_TEXTS, PRE_TOKENIZERS, PreTokenizer


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (gguf-py `TokenType`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_SPECIAL_TYPES = (TokenType.UNKNOWN, TokenType.CONTROL, TokenType.USER_DEFINED)



def _byte_level_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map (bytes that print stay themselves)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


_BYTE_CHARS = _byte_level_alphabet()
_UNBYTE = {ord(c): b for b, c in enumerate(_BYTE_CHARS)}
_UNBYTE_LATIN1 = {cp: chr(b) for cp, b in _UNBYTE.items()}  # str.translate table
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CLEAN_PUNCT = re.compile(rb" (?=[?!.,])")
_CLEAN_QUOTE = re.compile(rb" ' ")
_CLEAN_CONTRACTION = re.compile(rb" '(?=[sm]|re|ve)")


def _as_list(value: Any) -> list:
    """GGUF arrays arrive as lists, numpy arrays or lazy objects with `.tolist()`."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value)


def _as_str(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def _str_list(value: Any) -> list[str]:
    values = _as_list(value)
    try:
        "".join(values)  # C-speed check that every entry already is a str
        return values
    except TypeError:
        return [_as_str(v) for v in values]


def _scalar(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    return value


class Tokenizer:
    """Encode/decode with the vocabulary of one GGUF file; ids match llama.cpp's."""

    def __init__(self, tokens: list[str], types: np.ndarray, scores: np.ndarray, *, model: str,
                 pre: PreTokenizer | None, merges: list[str], md: Mapping[str, Any]) -> None:
        self.model = model
        self.vocab_size = len(tokens)
        self._text = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._ids = dict(zip(self._text, range(self.vocab_size)))
        if len(self._ids) != self.vocab_size:
            raise TokenizerError(_duplicate_message(self._text))
        self._types = types
        self._scores = scores.tolist()
        self._pre = pre
        self.add_space_prefix = bool(_scalar(md, "tokenizer.ggml.add_space_prefix", model == "llama"))
        self.clean_spaces = pre.clean_spaces if pre is not None else False
        self._read_special_ids(md)
        self.eog_ids = self._find_eog_ids(md)
        self._special = self._partition_order()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self.dropped_merges = 0
        self._bpe = self._build_bpe(merges) if model == "gpt2" else None

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*`); raises `TokenizerError` if unusable."""
        model = _as_str(_scalar(md, "tokenizer.ggml.model", ""))
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece); convert the model with a BPE or SPM vocabulary")
        if "tokenizer.ggml.tokens" not in md:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary")
        tokens = _str_list(md["tokenizer.ggml.tokens"])
        n = len(tokens)
        types = _int_array(md, "tokenizer.ggml.token_type", n, TokenType.NORMAL)
        scores = _float_array(md, "tokenizer.ggml.scores", n)
        pre, merges = None, []
        if model == "gpt2":
            pre_name = _as_str(_scalar(md, "tokenizer.ggml.pre", "default"))
            if pre_name not in PRE_TOKENIZERS:
                raise TokenizerError(
                    f"tokenizer.ggml.pre {pre_name!r} is not supported; known: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}")
            pre = PRE_TOKENIZERS[pre_name]
            if "tokenizer.ggml.merges" not in md:
                raise TokenizerError("BPE vocabulary without tokenizer.ggml.merges: the GGUF is incomplete")
            merges = _str_list(md["tokenizer.ggml.merges"])
        return cls(tokens, types, scores, model=model, pre=pre, merges=merges, md=md)

    def _read_special_ids(self, md: Mapping[str, Any]) -> None:
        spm = self.model == "llama"
        bos, eos = (1, 2) if spm else (11, 11)  # llama.cpp's defaults when the keys are absent
        self.bos_id = self._special_id(md, "bos", bos)
        self.eos_id = self._special_id(md, "eos", eos)
        self.unk_id = self._special_id(md, "unknown", 0 if spm else None)
        default_bos = True if spm else self._pre.add_bos
        self.add_bos = bool(_scalar(md, "tokenizer.ggml.add_bos_token", default_bos))
        self.add_eos = bool(_scalar(md, "tokenizer.ggml.add_eos_token", False))
        for flag, tid, name in ((self.add_bos, self.bos_id, "bos"), (self.add_eos, self.eos_id, "eos")):
            if flag and tid is None:
                raise TokenizerError(
                    f"tokenizer.ggml.add_{name}_token is true but tokenizer.ggml.{name}_token_id is "
                    "missing or out of range: fix the GGUF metadata")

    def _special_id(self, md: Mapping[str, Any], name: str, default: int | None) -> int | None:
        if default is not None and default >= self.vocab_size:
            default = None
        value = _scalar(md, f"tokenizer.ggml.{name}_token_id")
        if value is None or not 0 <= int(value) < self.vocab_size:
            return default
        return int(value)

    def _find_eog_ids(self, md: Mapping[str, Any]) -> frozenset[int]:
        """End-of-generation ids by llama.cpp's rules: eos/eot/eom plus well-known texts."""
        eog = set()
        for text in EOG_TEXTS | FIM_EOG_TEXTS:
            tid = self._ids.get(text)
            if tid is not None:
                eog.add(tid)
                self._types[tid] = TokenType.CONTROL
        for key in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
            tid = self.eos_id if key == "eos" else self._special_id(md, key, None)
            if tid is not None:
                eog.add(tid)
        texts = {self._text[i] for i in eog}
        if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
            eog.discard(self._ids["<|end|>"])  # harmony / solar-open: <|end|> closes a message only
            self._types[self._ids["<|end|>"]] = TokenType.USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(self._ids["</s>"])
            self._types[self._ids["</s>"]] = TokenType.NORMAL
        for text in ALWAYS_RENDERED:
            if text in self._ids:
                self._types[self._ids[text]] = TokenType.USER_DEFINED
        return frozenset(eog)

    def _partition_order(self) -> list[int]:
        ids = np.nonzero(np.isin(self._types, _SPECIAL_TYPES))[0].tolist()
        return sorted(ids, key=lambda i: (-len(self._text[i].encode()), i))

    def _build_bpe(self, merges: list[str]):
        from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

        valid = _merge_pairs(merges, self._ids)
        # HF's BPE cannot hold a merge whose parts or result are not tokens (it panics);
        # real files have none, and llama.cpp could only emit byte tokens for them anyway.
        self.dropped_merges = len(merges) - len(valid)
        model = models.BPE(self._ids, valid, ignore_merges=self._pre.ignore_merges)
        hf = HFTokenizer(model)
        splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in self._pre.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    # ---- encode -----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS as the file asks, `parse_special`
        turns control-token texts such as `<|im_start|>` into their ids."""
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # SPM prefixes a space to text at the start or after a special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self._bpe is not None:
                out.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
            else:
                prefix = " " if self.add_space_prefix and prev_special else ""
                out.extend(self._spm_encode((prefix + frag).replace(" ", "\u2581")))
                prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        frags: list[str | int] = [text] if text else []
        for tid in self._special:
            if not parse_special and self._types[tid] != TokenType.USER_DEFINED:
                continue
            needle = self._text[tid]
            if not any(isinstance(f, str) and needle in f for f in frags):
                continue
            split: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or needle not in f:
                    split.append(f)
                    continue
                for k, part in enumerate(f.split(needle)):
                    if k:
                        split.append(tid)
                    if part:
                        split.append(part)
            frags = split
        return frags

    def _spm_encode(self, text: str) -> list[int]:
        """Merge the highest-scoring adjacent pair until none is in the vocabulary."""
        ids, scores = self._ids, self._scores
        syms = list(text)
        nxt = [*range(1, len(syms)), -1]
        prv = list(range(-1, len(syms) - 1))
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            tid = ids.get(syms[left] + syms[right])
            if tid is not None:  # ties go to the leftmost pair, as in llama.cpp
                heapq.heappush(heap, (-scores[tid], left, right, len(syms[left]) + len(syms[right])))

        for i in range(1, len(syms)):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue  # stale: one side has merged since this pair was queued
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prv[nxt[left]] = left
            push(prv[left], left)
            push(left, nxt[left])
        out: list[int] = []
        i = 0 if syms else -1
        while i >= 0:
            tid = ids.get(syms[i])
            out.extend([tid] if tid is not None else self._byte_fallback(syms[i]))
            i = nxt[i]
        return out

    def _byte_fallback(self, piece: str) -> list[int]:
        out = []
        for b in piece.encode():
            tid = self._ids.get(f"<0x{b:02X}>")
            if tid is None:
                tid = self._ids.get(chr(b)) if b < 0x80 else None
            if tid is None:
                raise TokenizerError(
                    f"byte 0x{b:02X} of {piece!r} has no <0x{b:02X}> token in this SentencePiece "
                    "vocabulary: the GGUF's vocabulary lacks byte fallback")
            out.append(tid)
        return out

    # ---- decode -----------------------------------------------------------------------------

    def token_bytes(self, tid: int, *, special: bool = True) -> bytes:
        """The bytes llama.cpp's `token_to_piece` gives for one id (control tokens render
        their text only with `special`)."""
        key = (tid, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece(tid, special)
        return piece

    def _piece(self, tid: int, special: bool) -> bytes:
        if not 0 <= tid < self.vocab_size:
            raise TokenizerError(f"token id {tid} is outside the vocabulary (0..{self.vocab_size - 1})")
        kind, text = self._types[tid], self._text[tid]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode() if special else b""
        if kind == TokenType.USER_DEFINED:
            return text.encode()
        if kind == TokenType.BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(m.group(1), 16)]) if m else b""
        if kind != TokenType.NORMAL:
            return b""
        if self.model == "llama":
            return text.replace("\u2581", " ").encode()
        return _unbyte(text)

    def token_piece(self, tid: int) -> str:
        """Readable text of one token (special tokens included; split characters show as U+FFFD)."""
        return self.token_bytes(tid).decode("utf-8", errors="replace")

    def token_text(self, tid: int) -> str:
        """The raw vocabulary entry (byte-level or `▁`-escaped form)."""
        return self._text[tid]

    def token_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def detokenize(self, ids: Sequence[int], *, remove_special: bool = False,
                   unparse_special: bool = True) -> bytes:
        """llama.cpp's `llama_detokenize`, byte for byte."""
        ids = list(ids)
        strip_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, strip_space = ids[1:], False
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_bytes(i, special=unparse_special) for i in ids]
        if parts and strip_space and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        text = b"".join(parts)
        if self.clean_spaces:
            text = _CLEAN_PUNCT.sub(b"", text)
            text = _CLEAN_QUOTE.sub(b"'", text)
            text = _CLEAN_CONTRACTION.sub(b"'", text)
        return text

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; `skip_special` drops control tokens (and a leading BOS/trailing EOS)."""
        raw = self.detokenize(ids, remove_special=skip_special, unparse_special=not skip_special)
        return raw.decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids


class StreamDecoder:
    """Turns generated ids into text as they come, holding back incomplete UTF-8 characters.

    Pieces are llama.cpp's per-token pieces (what llama.cpp prints while generating); the
    whole-text clean-ups of `decode` (SPM leading space, `clean_spaces`) are not applied.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(tid, special=self._special))

    def flush(self) -> str:
        """Whatever is left; an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _merge_pairs(merges: list[str], ids: dict[str, int]) -> list[tuple[str, str]]:
    """`"a b"` merges as `(a, b)` pairs whose parts and result are tokens. The common case (no
    leading spaces, every merge valid) stays in C-level map/zip: this runs for 50k-150k merges."""
    if merges and not any(map(methodcaller("startswith", " "), merges)):
        parts = list(map(methodcaller("split", " ", 1), merges))
        if set(map(len, parts)) == {2}:
            left, right = zip(*parts)
            if (all(map(ids.__contains__, left)) and all(map(ids.__contains__, right))
                    and all(map(ids.__contains__, map(add, left, right)))):
                return list(zip(left, right))
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut > 0 and m[:cut] in ids and m[cut + 1:] in ids and m[:cut] + m[cut + 1:] in ids:
            pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _unbyte(text: str) -> bytes:
    """Byte-level BPE text back to bytes; characters outside the map are shown as llama.cpp does."""
    if all(ord(c) in _UNBYTE for c in text):
        return text.translate(_UNBYTE_LATIN1).encode("latin-1")
    out = bytearray()
    for c in text:
        if ord(c) in _UNBYTE:
            out.append(_UNBYTE[ord(c)])
        else:
            out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)


def _int_array(md: Mapping[str, Any], key: str, n: int, default: int) -> np.ndarray:
    arr = _array(md, key, n, np.int64, default)
    arr[(arr < 0) | (arr > TokenType.BYTE)] = TokenType.UNDEFINED
    return arr.astype(np.int32)


def _float_array(md: Mapping[str, Any], key: str, n: int) -> np.ndarray:
    return _array(md, key, n, np.float32, 0.0)


def _array(md: Mapping[str, Any], key: str, n: int, dtype, default) -> np.ndarray:
    """A per-token array; llama.cpp accepts longer ones and ignores the tail."""
    if key not in md:
        return np.full(n, default, dtype=dtype)
    arr = np.asarray(_as_list(md[key]), dtype=dtype)
    if arr.ndim != 1 or arr.size < n:
        raise TokenizerError(f"{key} has {arr.size} entries for {n} tokens: the GGUF vocabulary is inconsistent")
    return arr[:n].copy()


def _duplicate_message(texts: list[str]) -> str:
    seen: dict[str, int] = {}
    for i, t in enumerate(texts):
        if seen.setdefault(t, i) != i:
            return f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}; the GGUF is corrupt"
    return "duplicate token in vocabulary"
