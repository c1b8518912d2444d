"""llama.cpp's per-vocabulary rules, as data: the pre-tokenizer regex chain and flags of each
`tokenizer.ggml.pre` family, and the token texts that end generation (src/llama-vocab.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

# Pre-tokenizer regexes as llama.cpp applies them (src/llama-vocab.cpp). Each regex splits every
# fragment the previous one produced; matches and the text between them both become fragments.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` family splits text and sets llama.cpp's vocab flags."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenize drops " " before ?!., and in " 's" etc.
    ignore_merges: bool = False  # a word already in the vocabulary is one token
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token

    def __post_init__(self) -> None:
        if not self.regexes:
            raise ValueError("a pre-tokenizer needs at least one regex")


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_DIGITS_GPT2 = (r"\p{N}", _GPT2)
_PRE_FAMILIES: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("default",), _DEFAULT),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), PreTokenizer((_GPT2,))),
    (("smollm", "command-r"), PreTokenizer(_DIGITS_GPT2, clean_spaces=False)),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), PreTokenizer(_DIGITS_GPT2)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), PreTokenizer((_QWEN2,), clean_spaces=False)),
    (("megrez", "stablelm2"), PreTokenizer((_QWEN2,))),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {n: p for names, p in _PRE_FAMILIES for n in names}

# Token texts llama.cpp treats as end of generation (and forces to CONTROL), src/llama-vocab.cpp.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
# Fill-in-the-middle pad/repo/file-separator tokens: llama.cpp stops generation at these too.
FIM_EOG_TEXTS = frozenset((
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
))
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss
