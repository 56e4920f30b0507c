"""guided_regex and guided_json (engine/guided_regex.py, engine/guides.py): the output text
fully matches a pattern, or is JSON valid under a schema.

The vocabulary's bytes against its decoder; the trie's mask against each token walked on its
own; engine outputs against Python's re and json, the greedy one against the same model
stepped one token at a time with that step's allowed tokens given as allowed_token_ids;
seeded samples landing on several matches; a resumed request going on from its output; what
is refused. Through a router: tests/test_serving.py."""
from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
from types import SimpleNamespace

import pytest

from engine import SamplingParams
from engine.guided_regex import GuideCursor, TokenGuide, TokenTrie, _code_point_span
from engine.guides import Guides, guide_pattern
from engine.regex_dfa import DEAD, compile_regex
from engine.token_bytes import token_byte_strings
from tests.serving_helpers import final_output, random_prompts

PROMPTS = random_prompts(4, seed=5)
# Bounded, so that a greedy output ends "stop" within max_tokens whatever the model prefers.
PATTERNS = [r"(yes|no), [a-z]{2,8}( [a-z]{1,6}){0,3}\.",
            r"\d{3}-\d{2,4}",
            r"(café|naïve|日本語|🚀)+ ?[A-Z]{1,3}",
            r'"([^"\\\n]|\\.){0,12}"']
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def vocab(reference):
    return token_byte_strings(reference.tokenizer)


@pytest.fixture(scope="module")
def trie(vocab):
    return TokenTrie(vocab)


def _eos(reference) -> list[int]:
    return reference.engine.sampler.eos_token_ids


def test_each_tokens_bytes_are_what_the_tokenizer_decodes(reference, vocab):
    tok = reference.tokenizer
    assert all(vocab[i] is None for i in tok.all_special_ids)
    for text in ["plain words, and 42.", "café naïve Straße", "日本語 🚀 👩‍💻", "\t\n  x"]:
        ids = tok.encode_plain(text)
        assert b"".join(vocab[i] for i in ids) == text.encode("utf-8")
    # Some tokens hold part of a character: decoded alone they would be U+FFFD.
    partial = [b for b in vocab if b is not None and _not_utf8(b)]
    assert len(partial) > 50


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_sentencepiece_tokens_map_their_space_and_byte_pieces():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁hello": 3, "world": 4, "<0x0A>": 5,
             "<0xE6>": 6, "▁": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                   byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    tok = SimpleNamespace(backend=backend, vocab_size=8, all_special_ids=[0, 1, 2])
    assert token_byte_strings(tok) == [None, None, None, b" hello", b"world", b"\n", b"\xe6",
                                       b" "]


def test_code_point_spans_are_the_characters_that_begin_so():
    by_prefix: dict[bytes, list[int]] = {}
    for cp in [*range(0x80, 0x10000), *range(0x10000, 0x110000, 97), 0x10FFFF]:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        data = chr(cp).encode()
        for k in range(1, len(data)):
            by_prefix.setdefault(data[:k], []).append(cp)
    for prefix, cps in by_prefix.items():
        lo, hi = _code_point_span(prefix)
        assert lo <= min(cps) and max(cps) <= hi, prefix
        assert chr(lo).encode().startswith(prefix) and chr(hi).encode().startswith(prefix)
    for bad in [b"\x80", b"\xc0", b"\xe0\x80", b"\xed\xa0", b"\xf4\x90", b"\xf5", b"a"]:
        assert _code_point_span(bad) is None, bad


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_trie_allows_exactly_the_tokens_that_keep_the_text_matchable(pattern, trie,
                                                                          reference):
    guide = TokenGuide(compile_regex(pattern), trie, _eos(reference))
    rng = random.Random(7)
    state, seen = guide.start, 0
    for _ in range(12):  # a walk through the pattern, a random allowed token at a time
        allowed = set(guide.allowed(state).tolist())
        # Each token on its own, its bytes fed one by one: the same set.
        walked = {t for t, data in enumerate(trie.token_bytes)
                  if data and guide.advance(state, t) is not None}
        assert allowed - set(_eos(reference)) == walked
        assert (set(_eos(reference)) <= allowed) == guide.can_end(state)
        assert allowed  # never a dead end
        for t in walked:  # and each leads where something is allowed again
            nxt = guide.advance(state, t)
            assert guide.can_end(nxt) or nxt.pending or guide.allowed(nxt).numel()
        choices = sorted(walked)
        if not choices:
            break
        state = guide.advance(state, rng.choice(choices))
        seen += 1
    assert seen >= 2


TOY_VOCAB = [b"a", b"a", b"ab", b"ab", b"b", b"\xc3", b"\xc3", b"\xa9", b"\xc3\xa9", b"a\xc3",
             b"ba", b"aaa", b"\xe2\x82", b"\xac", b"", None, b"c", b"cc"]


@pytest.mark.parametrize("pattern", [r"a*b?", r"(?:ab|é)+", r"[^b]{1,3}", r"€|c+", r"b(?:a|é)"])
def test_a_walk_of_the_arrays_allows_what_feeding_each_token_allows(pattern):
    """A vocabulary with tokens of the same text (several on one trie node), tokens ending
    inside a character and tokens finishing one: at each state reached, the walk's set is
    the tokens whose bytes, fed one by one, keep the text matchable."""
    eos = len(TOY_VOCAB)
    guide = TokenGuide(compile_regex(pattern), TokenTrie(TOY_VOCAB), [eos])
    frontier, seen = [guide.start], set()
    while frontier:
        state = frontier.pop()
        if state in seen:
            continue
        seen.add(state)
        walked = {t for t, data in enumerate(TOY_VOCAB)
                  if data and guide.advance(state, t) is not None}
        assert set(guide.allowed(state).tolist()) - {eos} == walked, (pattern, state)
        frontier += [guide.advance(state, t) for t in walked]
    assert len(seen) >= 2


def _stepped(llm, prompt: list[int], pattern: str) -> list[int]:
    """The greedy output with each step's allowed tokens given as allowed_token_ids."""
    guide = TokenGuide(compile_regex(pattern), TokenTrie(token_byte_strings(llm.tokenizer)),
                       _eos(llm))
    out: list[int] = []
    state = guide.start
    while not out or out[-1] not in _eos(llm):
        allowed = guide.allowed(state).tolist()
        out += llm.generate([prompt + out], SamplingParams(
            max_tokens=1, temperature=0.0, allowed_token_ids=allowed))[0].token_ids
        if out[-1] not in _eos(llm):
            state = guide.advance(state, out[-1])
    return out


def test_greedy_outputs_match_and_pick_each_token_as_the_model_ranks_them(reference):
    texts = []
    for pattern in PATTERNS:
        outs = reference.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0,
                                                          guided_regex=pattern))
        for prompt, out in zip(PROMPTS, outs):
            assert re.fullmatch(pattern, out.text), (pattern, out.text)
            assert out.finish_reason == "stop"
            texts.append(out.text)
        assert outs[0].token_ids == _stepped(reference, PROMPTS[0], pattern)
    assert len(set(texts)) >= len(texts) - 2  # the prompts lead to different matches


def test_seeded_samples_match_and_differ(reference):
    pattern = PATTERNS[0]
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, guided_regex=pattern)
              for i in range(8)]
    outs = reference.generate([PROMPTS[1]] * 8, params)
    assert all(re.fullmatch(pattern, o.text) for o in outs)
    assert len({o.text for o in outs}) >= 6
    again = reference.generate([PROMPTS[1]] * 8, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def _valid(obj) -> bool:
    """SCHEMA's rules, written out."""
    props = SCHEMA["properties"]
    return (isinstance(obj, dict) and set(obj) <= set(props) and {"name", "age"} <= set(obj)
            and isinstance(obj["name"], str) and len(obj["name"]) <= 8
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120
            and all(v in ("a", "b", 3, None) for v in obj.get("tags", []))
            and len(obj.get("tags", [])) <= 3
            and type(obj.get("ok", True)) is bool)


def test_guided_json_outputs_are_valid_under_the_schema(reference):
    params = [SamplingParams(max_tokens=96, temperature=t, seed=i, guided_json=SCHEMA)
              for i, t in enumerate([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])]
    outs = reference.generate([PROMPTS[i % 4] for i in range(6)], params)
    objs = [json.loads(o.text) for o in outs]
    assert all(_valid(obj) for obj in objs), [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) >= 4
    # The schema as text guides the same.
    again = reference.generate([PROMPTS[0]], SamplingParams(
        max_tokens=96, temperature=0.0, guided_json=json.dumps(SCHEMA)))
    assert again[0].token_ids == outs[0].token_ids


def test_guided_json_spaces_as_its_whitespace_pattern_says(reference):
    """guided_whitespace_pattern "\\n": a newline on both sides of every comma, colon and
    bracket inside, in every output; and the pattern crosses the wire (client to proto to
    the engine's params) intact."""
    from client.types import build_request
    from protos.convert import sampling_from_proto

    sampling = dict(guided_json=SCHEMA, guided_whitespace_pattern="\n")
    req = build_request("x", None, sampling)
    assert sampling_from_proto(req.sampling).guided_whitespace_pattern == "\n"
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, **sampling)
              for i in range(4)]
    outs = reference.generate([PROMPTS[i % 4] for i in range(4)], params)
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(_valid(json.loads(o.text)) for o in outs), [o.text for o in outs]
    for o in outs:
        assert o.text.startswith('{\n"name"\n:\n'), o.text
        assert o.text.endswith("\n}"), o.text


def test_guided_json_follows_a_strings_pattern(reference):
    """JSON Schema's pattern (engine/json_string_pattern.py): each string's value matches
    its pattern, a quote and a backslash in it escaped as JSON needs."""
    schema = {"type": "object", "required": ["code", "mark"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,3}$"},
        "mark": {"type": "string", "pattern": '^(?:[a-c]|\\\\|")x$'}}}
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, guided_json=schema)
              for i in range(6)]
    outs = reference.generate([PROMPTS[i % 4] for i in range(6)], params)
    objs = [json.loads(o.text) for o in outs]
    assert all(re.fullmatch(r"[A-Z]{2}-\d{2,3}", o["code"]) for o in objs), objs
    assert all(re.fullmatch(r'(?:[a-c]|\\|")x', o["mark"]) for o in objs), objs
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) >= 4


def test_guided_json_writes_each_format_as_its_rfc_says(reference):
    """String formats (engine/json_formats.py) and OpenAPI's int32, sampled: every value
    passes the format's check (tests/json_format_oracles.py) and Python's own parser."""
    from tests.json_format_oracles import format_ok

    formats = ("ipv4", "ipv6", "date", "duration")
    schema = {"type": "object", "required": [*formats, "n"], "properties": {
        **{f: {"type": "string", "format": f} for f in formats},
        "n": {"type": "integer", "format": "int32"}}}
    params = [SamplingParams(max_tokens=256, temperature=1.0, seed=i, guided_json=schema)
              for i in range(4)]
    outs = reference.generate([PROMPTS[i % 4] for i in range(4)], params)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    objs = [json.loads(o.text) for o in outs]
    for obj in objs:
        assert all(format_ok(f, obj[f]) for f in formats), obj
        ipaddress.IPv4Address(obj["ipv4"]), ipaddress.IPv6Address(obj["ipv6"])
        datetime.date.fromisoformat(obj["date"])
        assert -2 ** 31 <= obj["n"] < 2 ** 31
    assert len({o.text for o in outs}) == 4


def test_guided_json_follows_a_recursive_schema(reference):
    """A self-referencing schema (engine/json_schema_regex.py's RECURSION_DEPTH): sampled
    outputs are valid trees, nested no deeper than the depth."""
    from engine.json_schema_regex import RECURSION_DEPTH

    schema = {"$defs": {"Node": {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}}}},
        "$ref": "#/$defs/Node"}

    def depth(node) -> int:
        kids = node.get("kids", [])
        assert set(node) <= {"id", "kids"} and 0 <= node["id"] <= 99 and len(kids) <= 2
        return 1 + max((depth(k) for k in kids), default=0)

    params = [SamplingParams(max_tokens=768, temperature=1.0, seed=i, guided_json=schema)
              for i in range(4)]
    outs = reference.generate([PROMPTS[i % 4] for i in range(4)], params)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    depths = [depth(json.loads(o.text)) for o in outs]
    assert all(d <= RECURSION_DEPTH + 1 for d in depths) and max(depths) > 1, depths


def test_guided_json_follows_joined_tagged_and_keyed_schemas(reference):
    """allOf (engine/json_all_of.py), a tagged oneOf (engine/json_one_of.py) and a map keyed
    by an enum (engine/json_objects.py), sampled: every output valid under the whole schema
    (the test validator counts oneOf's matches)."""
    from tests.test_json_schema_regex import valid

    schema = {"$defs": {"Base": {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99}}}}, "type": "object",
        "required": ["shape", "item"], "additionalProperties": False, "properties": {
            "shape": {"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"},
                                                  "r": {"type": "integer", "maximum": 9}},
                 "required": ["kind", "r"]},
                {"type": "object", "properties": {"kind": {"const": "square"},
                                                  "side": {"type": "boolean"}},
                 "required": ["kind"]}]},
            "counts": {"type": "object", "propertyNames": {"enum": ["red", "green"]},
                       "additionalProperties": {"type": "integer", "minimum": 0,
                                                "maximum": 9}},
            "item": {"allOf": [{"$ref": "#/$defs/Base"},
                               {"properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]}}}
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i, guided_json=schema)
              for i in range(4)]
    outs = reference.generate([PROMPTS[i % 4] for i in range(4)], params)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    objs = [json.loads(o.text) for o in outs]
    assert all(valid(obj, schema, schema) for obj in objs), [o.text for o in outs]
    assert len({o.text for o in outs}) >= 3


def test_a_resumed_request_goes_on_from_its_output(reference):
    tok = reference.tokenizer
    pattern = PATTERNS[0]
    params = SamplingParams(max_tokens=64, temperature=0.0, guided_regex=pattern)
    begun = tok.encode_plain("no, ab")
    engine = reference.engine
    engine.add_request("resumed", PROMPTS[0], params, resume_token_ids=begun)
    final = final_output(engine, "resumed")
    assert final.text.startswith("no, ab") and re.fullmatch(pattern, final.text)
    with pytest.raises(ValueError, match="does not match guided_regex at its token 0"):
        engine.add_request("astray", PROMPTS[0], params, resume_token_ids=tok.encode_plain("maybe"))


def test_a_cursor_catches_up_by_the_new_tokens_only(reference, trie):
    guide = TokenGuide(compile_regex(PATTERNS[1]), trie, _eos(reference))
    ids = reference.tokenizer.encode_plain("123-45")
    cursor = GuideCursor.after(guide, ids[:1], "p")
    assert cursor.consumed == 1
    assert set(cursor.allowed(ids).tolist()) == set(guide.allowed(cursor.state).tolist())
    assert cursor.consumed == len(ids) and cursor.state.dfa_state != DEAD


@pytest.mark.parametrize("kw, match", [
    (dict(guided_regex=""), "non-empty string"),
    (dict(guided_regex=5), "non-empty string"),
    (dict(guided_regex="a" * 16385), "16385 characters, more than 16384"),
    (dict(guided_json="{" * 65537), "65537 characters"),
    (dict(guided_regex="a", guided_choice=["a"]), "one guide at a time"),
    (dict(guided_regex="a", guided_json={"type": "string"}), "one guide at a time"),
    (dict(guided_regex="a", ignore_eos=True), "ignore_eos cannot be set"),
    (dict(guided_json={"type": "string"}, allowed_token_ids=[5]),
     "allowed_token_ids cannot be set"),
    (dict(guided_whitespace_pattern="[ ]*"), "applies to guided_json, which is not set"),
    (dict(guided_regex="a", guided_whitespace_pattern="[ ]*"), "applies to guided_json"),
    (dict(guided_json={"type": "object"}, guided_whitespace_pattern="\\s*"),
     "other than JSON's whitespace"),
])
def test_bad_guides_are_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(guided_regex="(a"), "never closed"),
    (dict(guided_regex=r"(a)\1"), "backreference"),
    (dict(guided_json="{not json"), "guided_json is not JSON"),
    (dict(guided_json={"type": "string", "pattern": "(?<=a)b"}), "'pattern' at #: bad regex"),
])
def test_guides_that_cannot_be_followed_are_refused_at_intake(reference, kw, match):
    params = SamplingParams(max_tokens=4, **kw)
    with pytest.raises(ValueError, match=match):
        reference.engine.add_request("bad-guide", PROMPTS[0], params)
    assert not reference.engine.has_unfinished_requests()


def test_a_guide_needs_a_tokenizer_and_an_eos():
    params = SamplingParams(guided_regex="a")
    with pytest.raises(ValueError, match="guided_regex needs a model with a tokenizer"):
        Guides(None, [2]).cursor(params, [])
    with pytest.raises(ValueError, match="this model has none"):
        Guides(object(), []).cursor(params, [])
    assert guide_pattern(SamplingParams()) is None


@pytest.mark.parametrize("guide", [dict(guided_regex=r"\d{3}-\d{2,4}"),
                                   dict(guided_choice=["yes", "no"])])
def test_min_tokens_past_a_whole_match_holds_it_whole(reference, guide, caplog):
    """eos is all a whole match allows; min_tokens bans it until the output is long enough,
    and the ban gives way (the only token left): the output goes on past an eos, which adds
    no text, and the guide still allows only eos. Found by the router fuzzer: the decode
    engine died on the eos (the cursor took it for a token leaving the pattern)."""
    eos = set(_eos(reference))
    outs = reference.generate(PROMPTS[:2], SamplingParams(max_tokens=40, min_tokens=12,
                                                          temperature=0.0, **guide))
    for out in outs:
        assert out.finish_reason == "stop" and len(out.token_ids) == 13  # 12, then its end
        assert eos & set(out.token_ids[:-1])  # eos sampled before the end, and gone on past
        text = reference.tokenizer.decode(out.token_ids)
        assert re.fullmatch(guide.get("guided_regex", "yes|no"), text), text
    assert "left its pattern" not in caplog.text  # followed, not ended as a stray token


def test_the_guided_bench_runs_both_sides_on_the_same_tokens():
    from argparse import Namespace

    from bench.guided import run

    cold, warm = run(Namespace(model="micro-llama", num_requests=3, regex=PATTERNS[1],
                               json=False))
    assert (cold.run, warm.run) == ("cold", "warm")
    # Seeded: the warm run makes the cold run's outputs again, 3 matches of 7-9 characters.
    assert cold.num_output_tokens == warm.num_output_tokens >= 3 * 3
    for p in (cold, warm):
        assert p.ratio == pytest.approx(p.guided_tok_s / p.unguided_tok_s)


def test_a_guide_keeps_allowed_sets_within_its_budget(reference, trie, monkeypatch):
    from engine import guided_regex

    monkeypatch.setattr(guided_regex, "_ALLOWED_CACHE_IDS", 20_000)
    monkeypatch.setattr(guided_regex, "_MAX_SHARED_DEPTH", 0)  # a set per state, as at a
    guide = TokenGuide(compile_regex(r".{0,30}"), trie, _eos(reference))  # count's end
    state = guide.start
    for _ in range(6):  # each count a state allowing most of the vocabulary
        allowed = guide.allowed(state)
        assert allowed.numel() > 7000
        state = guide.advance(state, reference.tokenizer.encode_plain("a")[0])
    assert guide._num_cached_ids <= 20_000 and len(guide._allowed) == 2
    assert guide._num_cached_ids == sum(ids.numel() for ids in guide._allowed.values())


def test_states_alike_as_far_as_a_token_reaches_share_one_walk(reference, trie, monkeypatch):
    """From each state of a count far from its end the automaton looks the same to the depth
    a walk reads (the longest token): one walk serves them all, and each state's set is the
    one its own walk finds."""
    import torch

    from engine import guided_regex

    pattern, a = r".{0,300}", reference.tokenizer.encode_plain("a")[0]
    shared = TokenGuide(compile_regex(pattern), trie, _eos(reference))
    states = [shared.start]
    for _ in range(300):
        states.append(shared.advance(states[-1], a))
    sets = [shared.allowed(s) for s in states]
    assert shared._depth < 100 and len(shared._allowed) <= shared._depth + 2
    monkeypatch.setattr(guided_regex, "_MAX_SHARED_DEPTH", 0)
    alone = TokenGuide(compile_regex(pattern), trie, _eos(reference))
    picked = [0, 1, 150, *range(300 - shared._depth - 1, 301, 2)]
    for i in picked:
        assert torch.equal(sets[i], alone.allowed(states[i])), i
    assert len({tuple(alone.allowed(states[i]).tolist()) for i in picked}) >= 4


def test_a_vocabulary_that_cannot_spell_what_comes_next_ends_the_output():
    """A SentencePiece vocabulary without byte fallback may lack a character the pattern needs
    next: eos, not an empty mask (which the sampler would read as no mask at all)."""
    vocab = [b"a", b"b", None, b"ab", "é".encode()[:1]]
    guide = TokenGuide(compile_regex("a(c|é)"), TokenTrie(vocab), [2])
    assert guide.allowed(guide.start).tolist() == [0]  # not "ab": b leaves the pattern
    after_a = guide.advance(guide.start, 0)
    # c is no token; é's first byte is, and some character that begins so goes on...
    assert guide.allowed(after_a).tolist() == [4]
    stuck = guide.advance(after_a, 4)
    # ...but no token brings its second byte.
    assert stuck.pending == b"\xc3" and guide.allowed(stuck).tolist() == [2]
