"""How an observation becomes token ids, rendered once and appended: the history is never re-rendered.

Between two policy turns a trajectory gets, in order:
- ``close_turn(sampled_ids)``: what the chat template puts after an assistant message that the policy did not sample
  itself (origin "template"). The closing is taken from the template: render [user, assistant] and keep what follows
  the assistant's content (ChatML: "<|im_end|>\\n"; the built-in tokenizer: "<eos>"), encoded once. A turn whose ids
  end with a prefix of those ids sampled it (ChatML's EOS is <|im_end|>): only the rest is appended, the longest such
  prefix winning; a turn stopped by a stop string or cut at its budget gets the whole closing.
- ``observation(obs)``: the observation's ids and per-token origins.
  A str is encoded as it is, a list of ids appended as given (all "environment"). Messages, in "template" mode, are
  the template's *delta* for them after a conversation that ends with a closed assistant turn, with
  add_generation_prompt=True, so the ids end by opening the next assistant turn: render a fixed base conversation
  [user, assistant] with the new messages after it, and keep what follows the base assistant's content and closing
  (verl's agent loop takes the same text difference against a fixed prefix). For a template that is append-only for
  these messages this is exactly render(base + messages) minus render(base); for one that is not (Qwen3 rewrites past
  assistant turns once a new user message follows), it is still what the template puts after the last assistant turn,
  and checks/template.py says the whole conversation would render differently. The delta is encoded once; a token
  is "environment" when its characters (the fast tokenizer's offset mapping) lie inside a message's content, else
  "template" (role headers, separators, the next turn's opening, and a token that straddles a content's edge).
  In "text" mode messages are their contents concatenated, encoded, all "environment", and nothing closes a turn.

A template that cannot render these conversations at all (it raises on a 'tool' role, its assistant content does not
appear verbatim) raises RenderError: the run is refused at start-up by checks/template.py, naming env.render=text and
data.chat_template as the ways out.
"""

from __future__ import annotations

MODES = ("template", "text")

# The fixed base conversation every delta is taken after. Private-use characters keep them from colliding with
# anything a template writes, and from the contents of the messages rendered after them.
BASE_USER = "\ue000base question\ue000"
BASE_ASSISTANT = "\ue001base answer\ue001"
BASE = [{"role": "user", "content": BASE_USER}, {"role": "assistant", "content": BASE_ASSISTANT}]


def _slot(i: int) -> str:
    """A stand-in for message i's content, to find where the template puts contents."""
    return f"\ue002{i}\ue003"


class RenderError(ValueError):
    """The chat template cannot render an observation as a delta (one line: what failed and how to proceed)."""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str:
    """The chat template's text for ``messages``; RenderError (one line) if it raises."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError (incl. the template's raise_exception), or a KeyError/TypeError
        roles = ", ".join(m["role"] for m in messages)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RenderError(f"the chat template fails on a conversation of roles [{roles}]: {first}") from None


class ObservationRenderer:
    def __init__(self, tokenizer, mode: str, tools=None):
        if mode not in MODES:
            raise ValueError(f"env.render={mode!r}: one of {', '.join(MODES)}")
        self.tok, self.mode, self.tools = tokenizer, mode, tools
        self.closing_text, self.closing = "", []
        if mode == "template":
            if not getattr(tokenizer, "chat_template", None):
                raise RenderError("env.render=template needs a chat template and the tokenizer has none: set "
                                  "data.chat_template or env.render=text")
            base = render(tokenizer, BASE, False, tools)
            at = base.rfind(BASE_ASSISTANT)
            if at < 0:
                raise RenderError("the chat template does not render an assistant message's content verbatim, so "
                                  "where a turn ends cannot be found: use env.render=text or data.chat_template")
            self.closing_text = base[at + len(BASE_ASSISTANT):]
            self.closing = self._encode(self.closing_text)

    def _encode(self, text: str, offsets: bool = False):
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=offsets)
        return (list(enc["input_ids"]), list(enc["offset_mapping"])) if offsets else list(enc["input_ids"])

    def close_turn(self, sampled_ids: list[int]) -> list[int]:
        """The closing ids the policy did not sample: ``closing`` less its longest prefix that ends the turn."""
        for k in range(min(len(self.closing), len(sampled_ids)), 0, -1):
            if list(sampled_ids[-k:]) == self.closing[:k]:
                return self.closing[k:]
        return list(self.closing)

    def delta_text(self, messages: list[dict]) -> str:
        """What the template puts after a closed assistant turn for ``messages``, ending with the next turn's
        opening (add_generation_prompt=True)."""
        full = render(self.tok, BASE + list(messages), True, self.tools)
        at = full.find(BASE_ASSISTANT)
        end = at + len(BASE_ASSISTANT)
        if at < 0 or not full.startswith(self.closing_text, end):
            roles = ", ".join(m["role"] for m in messages)
            raise RenderError(f"the chat template does not close an assistant turn with {self.closing_text!r} when "
                              f"[{roles}] messages follow it, so their delta cannot be taken: use env.render=text or "
                              "data.chat_template")
        return full[end + len(self.closing_text):]

    def content_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Where each message's content lies in ``text`` (its delta_text): the template's own text is found by
        rendering the same messages with stand-in contents, so a content equal to a header ("user", "\\n") cannot be
        mistaken for it, and one the template trims is delimited by the text around it."""
        skeleton = self.delta_text([{**m, "content": _slot(i)} for i, m in enumerate(messages)])
        pieces, rest = [], skeleton
        for i in range(len(messages)):
            head, sep, rest = rest.partition(_slot(i))
            if not sep:
                raise RenderError(f"the chat template drops or rewrites a {messages[i]['role']!r} message's content, "
                                  "so its tokens cannot be told from the template's: use env.render=text")
            pieces.append(head)
        pieces.append(rest)
        spans, pos = [], 0
        for i, m in enumerate(messages):
            head, after, last = pieces[i], pieces[i + 1], i == len(messages) - 1
            start = pos + len(head)
            verbatim = start + len(m["content"])  # the usual case: the content as it is, then the template's text
            if not text.startswith(head, pos):
                end = -1
            elif (text.startswith(m["content"], start) and text.startswith(after, verbatim)
                  and (not last or verbatim + len(after) == len(text))):
                end = verbatim
            elif last:
                end = len(text) - len(after) if text.endswith(after) else -1
            else:
                end = text.find(after, start) if after else -1
            if end < start:
                raise RenderError(f"the chat template renders {m['role']!r} messages differently by content, so "
                                  "their tokens cannot be told from the template's: use env.render=text")
            spans.append((start, end))
            pos = end
        return spans

    def observation(self, obs) -> tuple[list[int], list[str]]:
        """The observation's ids and each one's origin ("environment" or "template")."""
        if isinstance(obs, str):
            ids = self._encode(obs)
            return ids, ["environment"] * len(ids)
        if all(isinstance(i, int) for i in obs):
            return list(obs), ["environment"] * len(obs)
        if self.mode == "text":
            ids = self._encode("".join(m["content"] for m in obs))
            return ids, ["environment"] * len(ids)
        text = self.delta_text(obs)
        spans = self.content_spans(obs, text)
        ids, offsets = self._encode(text, offsets=True)
        origin = ["environment" if e > s and any(a <= s and e <= b for a, b in spans) else "template"
                  for s, e in offsets]
        return ids, origin
