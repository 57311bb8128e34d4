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

- ``ChatCodec``: a tokenizer with a chat template, for an environment that
  renders its tasks as chat messages (``envs.base.ChatRendering``). The prompt
  is the template applied to the environment's messages (system, user, any
  worked example); the model answers in its own format (a JSON tool call, or
  ``<tool_call>`` tags, in the assistant turn, which ends with the eos token);
  a tool result enters as a ``tool`` message: the ids of the template's text
  between the model's eos and the next assistant turn, loss mask 0.

Token-in/token-out: every id a codec returns is appended to the context as is
and is the id that lands and trains; nothing is ever re-tokenized from decoded
text (BPE merges across turn boundaries would give other ids).

``load(hf_dir, env=..., render=...)`` picks the codec from the directory's
tokenizer (pipeline.policy_store.tokenizer_rev) and the rendering: ``auto``
(the default) is chat when the tokenizer has a chat template and the
environment a chat rendering, text otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

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

    def prompt_ids(self, task) -> list[int]:
        return self.prompt(task.prompt)

    def observation_ids(self, output: str, last_id: int | None = None) -> list[int]:
        return [vocab.OBS_ID] + vocab.encode(output) + [vocab.END_OBS_ID]

    def template_rev(self, env) -> str:
        return str(env.prompt_template_rev)


class HFCodec:
    """A transformers tokenizer. The prompt starts with the bos token when the
    tokenizer has one; a final answer ends with the eos token."""

    char = False
    stop_strings: tuple[str, ...] = (END_CALL,)

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

    def prompt_ids(self, task) -> list[int]:
        return self.prompt(task.prompt)

    def observation_ids(self, output: str, last_id: int | None = None) -> list[int]:
        return self.encode(f"{OBS}{output}{END_OBS}")

    def template_rev(self, env) -> str:
        return str(env.prompt_template_rev)


_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class ChatCodec(HFCodec):
    """The environment's chat messages through the policy's chat template."""

    stop_strings: tuple[str, ...] = ()
    render = "chat"

    def __init__(self, hf_dir: str | Path, rev: str, env) -> None:
        super().__init__(hf_dir, rev)
        from pipeline.errors import ConfigError
        from pipeline.rollout.envs.base import ChatRendering

        if not self.tok.chat_template:
            raise ConfigError(f"{hf_dir}: the tokenizer has no chat template, so render=chat cannot be used",
                              hint="use render=text, or save a tokenizer with a chat template")
        if not isinstance(env, ChatRendering):
            raise ConfigError(f"environment {getattr(env, 'name', env)!r} has no chat rendering",
                              hint="use render=text, or give the environment chat_messages/chat_action/chat_answer")
        self.env = env
        self.eos_text = str(self.tok.eos_token)
        self._obs: dict[tuple[str, bool], list[int]] = {}
        # the template's text after the model's eos that closes an assistant turn ("\n" for ChatML)
        probe = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "\x00A"}]
        closed = self._text(probe, generation_prompt=False)
        k = closed.rfind("\x00A" + self.eos_text)
        self.after_eos = closed[k + len("\x00A" + self.eos_text):] if k >= 0 else ""
        self._probe = probe

    def _text(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))

    def prompt_ids(self, task) -> list[int]:
        """The environment's messages, rendered with the generation prompt, as ids."""
        return self.encode(self._text(self.env.chat_messages(task), generation_prompt=True))

    def observation_ids(self, output: str, last_id: int | None = None) -> list[int]:
        """A tool result as the ids between the model's turn and the next assistant turn:
        (the eos, when the turn stopped without it) + the rest of the closed assistant turn
        + the tool message + the generation prompt, as the template renders them."""
        key = (output, last_id == self.eos_id)
        if key not in self._obs:
            before = self._text(self._probe, generation_prompt=False)
            after = self._text(self._probe + [{"role": "tool", "content": output}], generation_prompt=True)
            if not after.startswith(before):
                from pipeline.errors import ConfigError

                raise ConfigError("the chat template renders earlier messages differently once a tool message "
                                  "follows; the observation tokens cannot be appended to the context",
                                  hint="use render=text for this policy")
            ids = ([] if key[1] else [self.eos_id]) + self.encode(self.after_eos + after[len(before):])
            self._obs = {} if len(self._obs) > 4096 else self._obs
            self._obs[key] = ids
        return list(self._obs[key])

    def parse(self, turn: list[int]) -> tuple[str | None, str | None]:
        """(tool action, answer) of a model turn: a JSON tool call ``{"name": ..., "arguments": {...}}``
        (bare, or inside ``<tool_call>`` tags) -> the environment's action text; otherwise, when the
        turn ended with the eos token, the environment's answer in the message (None: no answer)."""
        if not turn:
            return None, None
        ended = turn[-1] == self.eos_id
        text = self.tok.decode(turn[:-1] if ended else turn, skip_special_tokens=True).strip()
        call = parse_tool_call(text)
        if call is not None:
            action = self.env.chat_action(*call)
            return ("" if action is None else action), None
        return None, (self.env.chat_answer(text) if ended else None)

    def template_rev(self, env) -> str:
        """``<env chat rendering>@<sha256(chat template)[:12]>``: the rendering and the template
        that made the prompts, so admission compares like with like."""
        h = hashlib.sha256(json.dumps(self.tok.chat_template, sort_keys=True).encode()).hexdigest()[:12]
        fam, _, rev = str(env.chat_template_rev).rpartition("/")
        return f"{fam}@{h}/{rev}" if fam else f"{rev}@{h}"


def parse_tool_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of the first tool call in an assistant message: the JSON inside
    ``<tool_call>…</tool_call>`` when the message has the tags, else a message that starts
    with a JSON object (a one-element list of one also counts) with a string ``name`` and
    ``arguments`` (an object, or a JSON string of one). None when there is no such call."""
    m = _TOOL_TAG.search(text)
    body = m.group(1) if m else text.strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if isinstance(obj, list) and len(obj) >= 1:
        obj = obj[0]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


RENDERS = ("auto", "text", "chat")


def load(hf_dir: str | Path, env=None, render: str = "auto"):
    """The codec of a policy directory for ``env``: char for the built-in tokenizer,
    chat (``render=auto`` and a chat template and an environment with a chat rendering,
    or ``render=chat``), else the text protocol in the policy's tokenizer."""
    from pipeline.errors import ConfigError
    from pipeline.policy_store import tokenizer_rev

    if render not in RENDERS:
        raise ConfigError(f"render={render!r}: use one of {', '.join(RENDERS)}")
    rev = tokenizer_rev(hf_dir)
    if rev == vocab.TOKENIZER_REV:
        if render == "chat":
            raise ConfigError("render=chat: the built-in char tokenizer has no chat template", hint="use render=text")
        return CharCodec()
    if render == "text" or env is None:
        return HFCodec(hf_dir, rev)
    if render == "chat":
        return ChatCodec(hf_dir, rev, env)
    from pipeline.rollout.envs.base import ChatRendering

    codec = HFCodec(hf_dir, rev)
    if codec.tok.chat_template and isinstance(env, ChatRendering):
        return ChatCodec(hf_dir, rev, env)
    return codec


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
    if hasattr(codec, "parse"):          # a chat codec reads the model's own tool-call format
        return codec.parse(turn)
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
