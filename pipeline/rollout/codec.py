"""Text <-> token ids for the harness, with the *policy's* tokenizer.

Environments speak text (``<call>37*45</call>``, ``<obs>1665</obs>``,
``<ans>1665``); the harness turns it into the token ids the policy samples and
the trainer learns from. Two codecs:

- ``CharCodec``: the built-in char tokenizer (``vocab.py``), where every marker
  is one special token. Exactly the harness's original behaviour.
- ``HFCodec``: any tokenizer transformers loads (e.g. an imported BPE model).
  The markers are plain text there and a BPE merge can glue ``</call>`` to
  neighbouring characters, so stop strings are found by decoding and checking
  the text (``cut_at_stop``), never by matching token ids.

``load(hf_dir)`` picks the codec from the directory's tokenizer files
(pipeline.policy_store.tokenizer_rev).
"""

from __future__ import annotations

from pathlib import Path

from pipeline import vocab

CALL, END_CALL, OBS, END_OBS, ANS = vocab.CALL, vocab.END_CALL, vocab.OBS, vocab.END_OBS, vocab.ANS


class CharCodec:
    char = True
    rev = vocab.TOKENIZER_REV
    eos_id = vocab.EOS_ID
    stop_ids = (vocab.EOS_ID, vocab.END_CALL_ID)
    stop_strings: tuple[str, ...] = ()

    def prompt(self, text: str) -> list[int]:
        return [vocab.BOS_ID] + vocab.encode(text)

    def encode(self, text: str) -> list[int]:
        return vocab.encode(text)

    def decode(self, ids) -> str:
        return vocab.decode(list(ids))


class HFCodec:
    """A transformers tokenizer. The prompt starts with the bos token when the
    tokenizer has one; a final answer ends with the eos token."""

    char = False
    stop_strings = (END_CALL,)

    def __init__(self, hf_dir: str | Path, rev: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(hf_dir))
        self.rev = rev
        self.eos_id = int(self.tok.eos_token_id)
        self.bos_id = self.tok.bos_token_id
        self.stop_ids = (self.eos_id,)

    def prompt(self, text: str) -> list[int]:
        ids = self.encode(text)
        return ([int(self.bos_id)] + ids) if self.bos_id is not None else ids

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load(hf_dir: str | Path):
    from pipeline.policy_store import tokenizer_rev

    rev = tokenizer_rev(hf_dir)
    return CharCodec() if rev == vocab.TOKENIZER_REV else HFCodec(hf_dir, rev)


def cut_at_stop(codec, ids: list[int], stop_strings: tuple[str, ...]) -> int | None:
    """The length of the shortest prefix of ``ids`` whose decoded text contains a
    stop string (None when none does). Decode-and-check, so a stop string split
    over tokens, or merged into one token with its neighbours, is found."""
    if not stop_strings:
        return None
    text = codec.decode(ids)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(ids)          # the shortest prefix containing a stop string (monotone in k)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in codec.decode(ids[:mid]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def parse_turn(codec, turn: list[int]) -> tuple[str | None, str | None]:
    """(call text, answer text) of a model turn of a non-char codec: a call is
    ``<call>X</call>`` (text after ``</call>`` in the same token is ignored), an
    answer ``<ans>X`` followed by the eos token; None where the format is broken."""
    if not turn:
        return None, None
    ended = turn[-1] == codec.eos_id
    text = codec.decode(turn[:-1] if ended else turn).strip()
    if text.startswith(CALL) and END_CALL in text and not ended:
        body = text[len(CALL):text.index(END_CALL)]
        if "<" not in body and ">" not in body:
            return body, None
    if ended and text.startswith(ANS):
        body = text[len(ANS):]
        if "<" not in body and ">" not in body:
            return None, body
    return None, None
