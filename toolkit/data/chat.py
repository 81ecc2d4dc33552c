"""Chat rows -> checked messages -> the text the chat template renders, with each assistant turn's characters.

    to_messages     chat / alpaca / sharegpt rows -> [{"role", "content"}], refused with the file and row
    chat_spans      the rendered conversation and the (start, end) characters of its assistant turns
    Segments        a template that renders message by message: the spans from one render of the row
    Pieces          ... and a byte-level tokenizer that splits at each message's first (special) token: the
                    assistant tokens from the head tokens' ids, without character offsets (its fastest call)
    token_spans     the (first, last + 1) tokens that start inside those spans
    renderer        the compiled template, rendered directly where it agrees with apply_chat_template
"""

import itertools
import json
from contextlib import contextmanager
from operator import itemgetter

import numpy as np

import toolkit.data.tokens as tokens
from toolkit.errors import ConfigError, UnusableInput

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "model": "assistant", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")


def describe(value) -> str:
    return "missing" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"


def to_messages(fmt: str, record: dict, row: int, source: str) -> list:
    """A chat/alpaca/sharegpt row as a checked list of {"role", "content"} (strings)."""
    where = f"{source} row {row}"
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise UnusableInput(f"{where}: {key!r} is {describe(record.get(key))}, not a string")
        extra = record.get("input")
        extra = None if isinstance(extra, float) and extra != extra else extra  # an empty CSV cell reads as NaN
        if extra is not None and not isinstance(extra, str):
            raise UnusableInput(f"{where}: 'input' is {describe(extra)}, not a string")
        user = record["instruction"] + (f"\n\n{extra}" if extra and extra.strip() else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    key, role_key, text_key = ("messages", "role", "content") if fmt == "chat" else ("conversations", "from", "value")
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise UnusableInput(f"{where}: {key!r} is {'empty' if turns == [] else describe(turns)}; it must be a "
                            f"non-empty list of {{{role_key!r}, {text_key!r}}} objects")
    messages = []
    for n, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str):
            raise UnusableInput(f"{where}: message {n} has no {role_key!r} (a string); each message needs "
                                f"{role_key!r} and {text_key!r}")
        role = turn[role_key] if fmt == "chat" else SHAREGPT_ROLES.get(turn[role_key])
        if role not in ROLES:
            known = ROLES if fmt == "chat" else sorted(SHAREGPT_ROLES)
            raise UnusableInput(f"{where}: message {n} has {role_key} {turn[role_key]!r}; expected one of {known}")
        if not isinstance(turn.get(text_key), str):
            raise UnusableInput(f"{where}: message {n} ({turn[role_key]}) {text_key!r} is {describe(turn.get(text_key))}, "
                                "not a string")
        messages.append({"role": role, "content": turn[text_key]})
    return messages


def plain_messages(features) -> bool:
    """Is a chat dataset's "messages" column a list of objects holding exactly a "role" and a "content"
    string (what arrow_messages reads without Python per row)?"""
    from datasets import List, Value

    feature = features.get("messages")
    inner = getattr(feature, "feature", None) if isinstance(feature, List) else None
    return isinstance(inner, dict) and set(inner) == {"role", "content"} and all(
        inner[k] == Value("string") for k in inner)


def arrow_messages(column) -> list | None:
    """A chat batch's "messages" (an Arrow list<struct<role, content>> column) as message lists, checked in
    Arrow: every list non-empty, every role one of ROLES and every content a string. None where a row fails
    a check (to_messages then finds it and refuses it by its row number)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if lists.null_count or len(lists) and pc.min(pc.list_value_length(lists)).as_py() == 0:
        return None
    objects = lists.flatten()
    role, content = objects.field("role"), objects.field("content")
    if objects.null_count or role.null_count or content.null_count or not set(pc.unique(role).to_pylist()) <= set(
            ROLES):
        return None
    # Python objects from the two string columns: a struct array's to_pylist costs 2-3x more (and imports pandas)
    messages = [{"role": r, "content": c} for r, c in zip(role.to_pylist(), content.to_pylist())]
    bounds = pc.subtract(lists.offsets, lists.offsets[0]).to_pylist()  # a batch may be a slice of the column
    return [messages[a:b] for a, b in zip(bounds, bounds[1:])]


def check_chat_template(tokenizer) -> None:
    """Chat formats need a template: the tokenizer's, or --chat-template FILE."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this data is chat-formatted but the tokenizer has no chat template to render it with; "
                          "pass --chat-template FILE (a Jinja template, e.g. ChatML), or --format with another "
                          "format")


def check_template_syntax(template: str, path: str) -> None:
    """--chat-template FILE must compile: a Jinja syntax error is refused at once, naming the file, the
    line and jinja's message. (A template that raises on some conversation is named with the row that
    made it raise, in render_chat.) Rendered as transformers renders it, on a one-turn conversation."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template([[{"role": "user", "content": "hello"}]], chat_template=template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: line {exc.lineno}: {exc.message} (a Jinja syntax error); "
                          "fix the template") from None
    except Exception:  # noqa: BLE001 - it compiled; refusing this probe conversation is the template's right
        pass


def render_chat(messages: list, tok, source: str = "", row: int = 0) -> tuple[list, list]:
    """(input_ids, is_assistant per token) of one conversation rendered with the chat template."""
    full, spans = chat_spans(messages, tok, source, row)
    if tokens.backend(tok) is None:
        return tokens_by_piece(full, spans, tok)
    encoded = tokens.encode(tok, [full], offsets=True)[0]
    return encoded.ids, marks(encoded.offsets, spans).tolist()


def chat_spans(messages: list, tok, source: str = "", row: int = 0, render=None, segments=None) -> tuple[str, list]:
    """_chat_spans, with a template's own error named by the row that raised it."""
    with template_errors(source, row):
        return _chat_spans(messages, tok, source, row, render, segments)


@contextmanager
def template_errors(source: str, row: int):
    """A chat template's own error (Jinja's, or Python's inside it) as a refusal naming the row."""
    from jinja2 import TemplateError

    try:
        yield
    except ConfigError:  # dstk's own refusal (UnusableInput included), already naming the row
        raise
    except TemplateError as exc:
        line = f" (template line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise UnusableInput(f"{source} row {row}: the chat template failed{line}: {exc.message or exc}; fix the "
                            "row or the template (--chat-template FILE)") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:  # Python inside Jinja
        raise UnusableInput(f"{source} row {row}: the chat template failed: {type(exc).__name__}: {exc}; fix the "
                            "row or the template (--chat-template FILE)") from None


def _chat_spans(messages: list, tok, source: str = "", row: int = 0, render=None, segments=None) -> tuple[str, list]:
    """(the conversation rendered with the chat template, [(start, end)] characters of each assistant turn).

    An assistant turn's characters run from the end of render(messages[:i], add_generation_prompt)
    to the end of render(messages[:i+1]) (its content and end-of-turn marker); both renders must be
    prefixes of the whole conversation's, else the template rewrites earlier turns and is refused.
    With `segments` (the template's Segments) a row it renders exactly is not rendered again per turn."""
    render = render or renderer(tok)
    full = render(messages, generation_prompt=False)
    spans = segments.spans(messages, full) if segments is not None else None
    if spans is not None:
        return full, spans
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(messages[:i], generation_prompt=True) if i else ""
        end = full if i == len(messages) - 1 else render(messages[: i + 1], generation_prompt=False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ConfigError(f"{source} row {row}: the chat template renders turn {i + 1} differently once later "
                              "turns follow (the text of a conversation's start is not a prefix of the whole), so "
                              "the assistant's tokens cannot be found; pass --chat-template FILE with a template "
                              "that keeps earlier turns as they are, or --train-on all")
        spans.append((len(start), len(end)))
    return full, spans


class Segments:
    """A chat template that renders a conversation as `start` followed, per message, by head[role] + content +
    tail[role], and asks for a reply with `prompt` (a prefix of the assistant's head): ChatML, Llama 3, Phi-3,
    Gemma's turns and most others. Then render(messages[:i]) is the text before message i, and an assistant
    turn's characters (what chat_spans finds by rendering every turn's prefixes) follow from the lengths.

    Learned from probe conversations (`learn`); a row is taken this way only where its one render equals the
    pieces joined, else chat_spans renders its prefixes (a template that trims contents, says something else
    on a last turn or adds a default system prompt costs the renders, never a wrong token)."""

    def __init__(self, start: str, heads: dict, tails: dict, prompt: str):
        self.start, self.heads, self.tails, self.prompt = start, heads, tails, prompt

    def spans(self, messages: list, full: str) -> list | None:
        """The assistant turns' (start, end) characters in `full` (the row's render), or None where the row does
        not render as the pieces (a role or a template branch the probes did not show)."""
        texts = self.texts(messages, full)
        if texts is None:
            return None
        spans, at, cue = [], 0, len(self.prompt)
        for message, text in zip(messages, texts):
            if message["role"] == "assistant":
                spans.append((at + len(text) - len(message["content"]) - len(self.tails["assistant"])
                              - len(self.heads["assistant"]) + cue, at + len(text)))
            at += len(text)
        return spans

    def matches(self, messages: list, full: str) -> bool:
        """Does `full` (the row's render) equal start + head + content + tail of each message? (texts() without
        building each message's text: one join of the pieces)"""
        heads, tails, pieces = self.heads, self.tails, [self.start]
        for message in messages:
            role = message["role"]
            if role not in heads:
                return False
            pieces += (heads[role], message["content"], tails[role])
        return "".join(pieces) == full

    def texts(self, messages: list, full: str) -> list | None:
        """Each message's text in `full` (the first with `start`): head + content + tail; None where the row
        does not render as these pieces joined."""
        heads, tails, out = self.heads, self.tails, []
        for message in messages:
            role = message["role"]
            if role not in heads:
                return None
            out.append(heads[role] + message["content"] + tails[role])
        if out:
            out[0] = self.start + out[0]
        return out if sum(map(len, out)) == len(full) and "".join(out) == full else None

    @classmethod
    def learn(cls, render) -> "Segments | None":
        """The template's pieces from the probes' renders, or None where it does not render message by message
        (checked: every prefix of every probe renders as the pieces, and the generation prompt as `prompt`)."""
        first, heads, tails = {}, {}, {}
        for probe in SEGMENT_PROBES:
            before = ""
            for k, message in enumerate(probe):
                text = render(probe[: k + 1], generation_prompt=False)
                at = text.find(message["content"], len(before))
                if not text.startswith(before) or at < 0:
                    return None
                head, tail = text[len(before): at], text[at + len(message["content"]):]
                role = message["role"]
                if k == 0:
                    first[role] = head  # start + the role's head
                elif heads.setdefault(role, head) != head:
                    return None
                if tails.setdefault(role, tail) != tail:
                    return None
                before = text
        if not first.get("user", "").endswith(heads.get("user", "\0")) or "assistant" not in heads:
            return None
        start = first["user"][: len(first["user"]) - len(heads["user"])]
        if "system" in first and first["system"].startswith(start):
            heads.setdefault("system", first["system"][len(start):])
        reply = SEGMENT_PROBES[0][:1]
        asked = render(reply, generation_prompt=True)
        plain = render(reply, generation_prompt=False)
        if not asked.startswith(plain) or not heads["assistant"].startswith(asked[len(plain):]):
            return None
        model = cls(start, heads, tails, asked[len(plain):])
        for probe in SEGMENT_PROBES:  # every prefix, and every generation prompt, as the pieces say
            for k in range(1, len(probe) + 1):
                text = render(probe[:k], generation_prompt=False)
                if model.spans(probe[:k], text) is None:
                    return None
                if probe[k - 1]["role"] == "user" and render(probe[:k], generation_prompt=True) != text + model.prompt:
                    return None
        return model


SEGMENT_PROBES = ([{"role": "user", "content": "dstk probe u1"}, {"role": "assistant", "content": "dstk probe a1"},
                   {"role": "user", "content": "dstk probe u2"}, {"role": "assistant", "content": "dstk probe a2"},
                   {"role": "user", "content": "dstk probe u3"}, {"role": "assistant", "content": "dstk probe a3"}],
                  [{"role": "system", "content": "dstk probe s1"}, {"role": "user", "content": "dstk probe u4"},
                   {"role": "assistant", "content": "dstk probe a4"}, {"role": "user", "content": "dstk probe u5"},
                   {"role": "assistant", "content": "dstk probe a5"}])


class Pieces:
    """Assistant tokens of a whole render tokenized without character offsets (the tokenizer's fastest call), where
    the template renders message by message (Segments) and every message's head starts with a special token
    (no lstrip, no single_word, not normalized): the tokenizer splits the text at special tokens before anything
    else, so each message's tokens start at its head token's id, and the k-th head-token id of a row is the k-th
    message's (after those of `start`) unless a content holds the token's text too (then the row's count is off
    and it goes the offsets way). An assistant message's reply starts after the generation prompt's tokens (as
    they come before a reply that starts with a letter) when its tokens begin with them (byte-level tokenizers:
    the same token strings cover the same bytes); where they do not (a reply opening with whitespace or a sign
    that merges with the prompt's end), the row goes the offsets way. Checked on the probe conversations against
    the whole render's offsets."""

    def __init__(self, segments: Segments, heads: list, start_heads: int, prompt_ids: list):
        self.segments, self.prompt_ids = segments, prompt_ids
        self.heads, self.start_heads = np.asarray(heads, np.int64), start_heads

    @classmethod
    def of(cls, tok, segments: "Segments | None", render) -> "Pieces | None":
        engine = tokens.backend(tok)
        if segments is None or engine is None or not _byte_level(json.loads(engine.to_str()).get("pre_tokenizer")):
            return None
        splits = {t.content: i for i, t in engine.get_added_tokens_decoder().items()
                  if not (t.lstrip or t.single_word or t.normalized)}
        heads = set()
        for head in segments.heads.values():
            found = max((c for c in splits if head.startswith(c)), key=len, default=None)
            if found is None:
                return None
            heads.add(splits[found])
        encode = lambda texts: engine.encode_batch(texts, add_special_tokens=False)  # noqa: E731
        start, prompt = encode([segments.start, segments.prompt + "x"])  # the prompt's tokens before a reply
        cue = [t for t, (a, _) in zip(prompt.ids, prompt.offsets) if a < len(segments.prompt)]
        if not cue or prompt.offsets[len(cue) - 1][1] != len(segments.prompt):
            return None
        model = cls(segments, sorted(heads), sum(t in heads for t in start.ids), cue)
        for probe in SEGMENT_PROBES:
            full = render(probe, generation_prompt=False)
            encoding = encode([full])[0]
            found = model.row_spans(encoding.ids, probe)
            if found is None or found != token_spans(encoding, segments.spans(probe, full)):
                return None
        return model

    def turns(self, rows: list, conversations: list) -> tuple:
        """Of `rows` (token id lists) of `conversations` (their messages), in NumPy over the whole chunk: (their ids
        flat (int32), their offsets, per row: are its turns found (bool), and (row, first, last + 1) of each
        found row's assistant replies with their end markers, row-relative). A row is not found where its head
        tokens do not match its messages or a reply's tokens do not begin with the prompt's (offsets decide)."""
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        bounds = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=bounds[1:])
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(bounds[-1]))
        at = np.flatnonzero(np.isin(flat, self.heads))
        first = np.searchsorted(at, bounds) + self.start_heads  # each row's first message head (after `start`'s)
        count = np.fromiter(map(len, conversations), np.int64, len(rows))
        ok = first[1:] - self.start_heads - first[:-1] == count
        # every message of the rows whose head count matches: its row, first token, end (the next head or row end)
        row = np.repeat(np.flatnonzero(ok), count[ok])
        head = np.repeat(first[:-1][ok], count[ok]) + np.arange(len(row)) - np.repeat(np.cumsum(count[ok]) - count[ok],
                                                                                    count[ok])
        start = at[head] if len(row) else np.zeros(0, np.int64)
        last = np.append(row[1:] != row[:-1], True)  # a row's last message
        end = np.where(last, bounds[row + 1], np.append(start[1:], 0))
        assistant = np.fromiter((m["role"] == "assistant" for n in np.flatnonzero(ok).tolist()
                                 for m in conversations[n]), bool, len(row))
        cue = np.asarray(self.prompt_ids, np.int32)
        reply = start + len(cue)
        inside = reply <= bounds[row + 1]
        where = np.minimum(start[:, None] + np.arange(len(cue)), max(len(flat) - 1, 0))
        prompted = inside & (flat[where] == cue).all(axis=1) if len(flat) else inside
        bad = assistant & ~prompted
        ok[row[bad]] = False
        keep = assistant & ok[row] & (reply < end)
        ranges = np.stack([row[keep], reply[keep] - bounds[row[keep]], end[keep] - bounds[row[keep]]], axis=1)
        return flat, bounds, ok, ranges

    def row_spans(self, ids: list, messages: list) -> list | None:
        """turns() of one row: [(first, last + 1)] of its assistant replies, or None where offsets must decide."""
        _, _, ok, ranges = self.turns([ids], [messages])
        return [(int(a), int(b)) for _, a, b in ranges] if ok[0] else None


def _byte_level(pre_tokenizer) -> bool:
    """Is there a ByteLevel step among the pre-tokenizer's (its tokens' strings are the text's bytes)?"""
    if not isinstance(pre_tokenizer, dict):
        return False
    return pre_tokenizer.get("type") == "ByteLevel" or any(_byte_level(p) for p in pre_tokenizer.get("pretokenizers",
                                                                                                      []))


def token_spans(encoding, spans: list) -> list | None:
    """[(first, last + 1)] token indices of the tokens that start inside each character span (what `marks` finds
    from every token's offsets), from a few lookups per span; None where a span's edge falls on a character no
    token covers (a tokenizer that drops whitespace: use marks)."""
    out, count = [], len(encoding.ids)
    for a, b in spans:
        if a >= b:
            continue
        first, last = encoding.char_to_token(a), encoding.char_to_token(b - 1)
        if first is None or last is None:
            return None
        while first <= last and encoding.token_to_chars(first)[0] < a:  # a token begun before the span
            first += 1
        while last + 1 < count and encoding.token_to_chars(last + 1)[0] < b:  # bytes of the span's last character
            last += 1
        if first <= last:
            out.append((first, last + 1))
    return out


def marks(offsets: list, spans: list) -> np.ndarray:
    """Per token (its (start, end) characters): does it start inside one of `spans` (sorted, disjoint)?"""
    starts = np.fromiter(map(itemgetter(0), offsets), np.int64, len(offsets))  # C-level map: no Python loop body
    if not spans:
        return np.zeros(len(starts), bool)
    lo, hi = np.asarray(spans, np.int64).T
    k = np.searchsorted(lo, starts, side="right") - 1
    return (k >= 0) & (starts < hi[np.maximum(k, 0)])


def tokens_by_piece(full: str, spans: list, tok) -> tuple[list, list]:
    """Slow tokenizers (no character offsets): the text between and inside the spans tokenized piece by piece."""
    ids, flags, cut = [], [], 0
    for a, b in spans + [(len(full), len(full))]:
        for text, mark in ((full[cut:a], False), (full[a:b], True)):
            piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
            ids, flags = ids + piece, flags + [mark] * len(piece)
        cut = b
    return ids, flags


def renderer(tok):
    """render(messages, generation_prompt) -> tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=
    generation_prompt) for checked messages (plain {role, content} strings): the compiled template rendered with
    the special tokens, as apply_chat_template renders it after copying and normalising every message (which
    costs more than the render itself), where the two agree on a probe conversation; else apply_chat_template."""
    key = template_key(tok)
    if key not in _TEMPLATES:
        _TEMPLATES[key] = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            render = _direct(_compile_jinja_template(key[0]), tok.special_tokens_map)
            same = all(render(PROBE[:n], g) == tok.apply_chat_template(PROBE[:n], tokenize=False,
                                                                         add_generation_prompt=g)
                       for n in (2, 3, 5) for g in (False, True))
            _TEMPLATES[key] = render if same else None
        except Exception:  # noqa: BLE001 - transformers' own path renders it (and names the error per row)
            pass
    if _TEMPLATES[key] is None:
        return lambda messages, generation_prompt: tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
    return _TEMPLATES[key]


def _direct(compiled, special: dict):
    """compiled.render(messages=..., tools=None, documents=None, add_generation_prompt=..., **special), with the
    template's globals (a ChainMap over its environment's, which Template.render merges and lists key by key on
    every call: two thirds of its cost per row) flattened into a dict once: the same context, built from it."""
    from jinja2.runtime import new_context

    names = dict(compiled.globals)
    base = {**names, "tools": None, "documents": None, **special}
    environment, concat, root = compiled.environment, compiled.environment.concat, compiled.root_render_func

    def render(messages: list, generation_prompt: bool) -> str:
        context = new_context(environment, compiled.name, compiled.blocks, {**base, "messages": messages,
                              "add_generation_prompt": generation_prompt}, shared=True, globals=names)
        try:
            return concat(root(context))
        except Exception:  # noqa: BLE001 - what Template.render does: Jinja's error, its traceback rewritten
            environment.handle_exception()

    return render


def template_key(tok) -> tuple:
    """What a tokenizer renders conversations with: its chat template and special tokens."""
    text = tok.get_chat_template() if isinstance(getattr(tok, "chat_template", None), (str, dict)) else None
    return text, json.dumps(tok.special_tokens_map, sort_keys=True, default=str)


def pieces(tok, render=None) -> Pieces | None:
    """The tokenizer and template as Pieces, where messages can be tokenized alone (decided once per template)."""
    key = (template_key(tok), id(tokens.backend(tok)))
    if key not in _PIECES:
        render = render or renderer(tok)
        try:
            _PIECES[key] = Pieces.of(tok, segments(tok, render), render)
        except Exception:  # noqa: BLE001 - whole renders with offsets instead
            _PIECES[key] = None
    return _PIECES[key]


def segments(tok, render=None) -> Segments | None:
    """The tokenizer's template as Segments, where it renders message by message (learned once per template)."""
    key = template_key(tok)
    if key not in _SEGMENTS:
        try:
            _SEGMENTS[key] = Segments.learn(render or renderer(tok))
        except Exception:  # noqa: BLE001 - a template that refuses a probe: chat_spans renders every prefix
            _SEGMENTS[key] = None
    return _SEGMENTS[key]


_TEMPLATES: dict = {}
_SEGMENTS: dict = {}
_PIECES: dict = {}
PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}]
