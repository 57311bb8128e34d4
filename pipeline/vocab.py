"""The character-level vocabulary of the built-in policy (pure Python, no deps; below
both the policy store, which recognizes its tokenizer, and the rollout engines).

One token per character plus a few markers. The same table is saved as a
Hugging Face ``tokenizer.json`` (``hf.build_tokenizer``) so both engines and the
trainer load it from the checkpoint directory; the harness encodes and decodes
with this module directly (fast, and identical: tests/rollout/test_policy.py).

A multi-turn trajectory on ``arithmetic-tool`` reads, token by token::

    <bos>37*45=            prompt                      (prompt_ids)
    <call>37*45</call>     turn 1, sampled by policy   (loss_mask 1)
    <obs>1665</obs>        calculator output           (loss_mask 0)
    <ans>1665<eos>         turn 2, sampled by policy   (loss_mask 1)
"""

from __future__ import annotations

import hashlib

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CALL, END_CALL, OBS, END_OBS, ANS = "<call>", "</call>", "<obs>", "</obs>", "<ans>"
SPECIAL = [PAD, BOS, EOS, UNK, CALL, END_CALL, OBS, END_OBS, ANS]
CHARS = list("0123456789+-*/=()<>?:., ") + list("abcdefghijklmnopqrstuvwxyz")
TOKENS = SPECIAL + CHARS
ID = {t: i for i, t in enumerate(TOKENS)}

PAD_ID, BOS_ID, EOS_ID, UNK_ID = ID[PAD], ID[BOS], ID[EOS], ID[UNK]
CALL_ID, END_CALL_ID, OBS_ID, END_OBS_ID, ANS_ID = ID[CALL], ID[END_CALL], ID[OBS], ID[END_OBS], ID[ANS]
VOCAB_SIZE = len(TOKENS)

# Changes whenever TOKENS changes: every trajectory records it (tokenizer_rev).
TOKENIZER_REV = "char-" + hashlib.sha256("\x00".join(TOKENS).encode()).hexdigest()[:12]


def encode(text: str) -> list[int]:
    """Markers (``<call>`` …) are single tokens; every other character is one token."""
    out: list[int] = []
    i = 0
    while i < len(text):
        if text[i] == "<":
            j = text.find(">", i)
            if j > 0 and text[i:j + 1] in ID and text[i:j + 1] in SPECIAL:
                out.append(ID[text[i:j + 1]])
                i = j + 1
                continue
        out.append(ID.get(text[i], UNK_ID))
        i += 1
    return out


def decode(ids: list[int] | tuple[int, ...]) -> str:
    return "".join(TOKENS[i] if 0 <= i < VOCAB_SIZE else UNK for i in ids)
