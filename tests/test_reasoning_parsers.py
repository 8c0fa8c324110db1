"""Reasoning formats on recorded outputs (pure Python): the whole split, and a stream of the
same text cut at every character giving the same reasoning and content; the reasoning gate
that starts a grammar after the reasoning; vLLM's bad words."""

import pytest

from arcjax.reasoning import PARSERS
from arcjax.reasoning.reasoning_gate import AFTER, BEFORE, IN, ReasoningGate
from arcjax.structured.bad_words import BadWordsMask, bad_word_ids
from arcjax.structured.mask_source import MaskPlan, MaskSource, stack

HARMONY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
           "<|channel|>final<|message|>It is sunny in Paris.<|return|>")
# (parser, prompt opening, recorded output, reasoning, content)
RECORDED = [
    ("deepseek_r1", "open", "Okay, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4.",
     "Okay, 2 + 2.\nThat is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "none", "<think>\nHmm.\n</think>Four.", "\nHmm.\n", "Four."),
    ("deepseek_r1", "open", "Still thinking when cut <", "Still thinking when cut <", None),
    ("deepseek_r1", "closed", "Four.</think>x", None, "Four.</think>x"),
    ("qwen3", "none", "<think>\nLet me see.\n</think>\n\nHello!", "\nLet me see.\n",
     "\n\nHello!"),
    ("qwen3", "none", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "none", "<thin", None, "<thin"),  # never became the marker
    ("qwen3", "open", "ok.</think>Answer", "ok.", "Answer"),
    ("qwen3", "closed", "<think>x</think>y", None, "<think>x</think>y"),
    ("openai_gptoss", "open", HARMONY, "The user wants the weather.", "It is sunny in Paris."),
    ("openai_gptoss", "open", "<|channel|>analysis<|message|>Cut mid-thought <|e",
     "Cut mid-thought <|e", None),
]


def _whole(parser, opening, text):
    r, c, any_r, any_c = parser.split(text, opening, True).parts(text)
    return (r if any_r else None), (c if any_c else None)


def _streamed(parser, opening, text, cuts):
    """Reasoning and content sent by a stream that sees text[:k] for each k in cuts (as the
    engine's outputs do: each delta is the newly decided characters)."""
    reasoning, content, sent = [], [], 0
    for k in [*cuts, len(text)]:
        final = k == len(text)
        split = parser.split(text[:k], opening, final)
        assert split.decided >= sent, "decided moved back"
        r, c, _, _ = split.parts(text[:k], sent)
        reasoning.append(r)
        content.append(c)
        sent = split.decided
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("name, opening, text, reasoning, content", RECORDED)
def test_split_whole_and_at_every_character(name, opening, text, reasoning, content):
    parser = PARSERS[name]()
    assert _whole(parser, opening, text) == (reasoning, content)
    want = (reasoning or "", content or "")
    for cut in range(len(text) + 1):  # one split point ...
        assert _streamed(parser, opening, text, [cut]) == want, cut
    assert _streamed(parser, opening, text, range(len(text))) == want  # ... and all of them


def test_openings_from_the_prompt():
    think = PARSERS["qwen3"]()
    assert think.opening("<|im_start|>assistant\n<think>\n") == "open"
    assert think.opening("assistant\n<think>\n\n</think>\n\n") == "closed"
    assert think.opening("<|im_start|>assistant\n") == "none"
    assert PARSERS["openai_gptoss"]().opening("<|start|>assistant") == "open"


class FakeGrammar(MaskSource):
    """Accepts every token but 99, remembers what it accepted, fills a marker row."""

    def __init__(self):
        self.accepted, self.num_tokens = [], 0

    def accept(self, token):
        self.accepted.append(token)
        self.num_tokens += 1
        return token != 99

    def rewind_to(self, n):
        del self.accepted[n:]
        self.num_tokens = n

    def valid_prefix(self, tokens):
        return next((i for i, t in enumerate(tokens) if t == 99), len(tokens))

    def mask_plan(self, index, drafts):
        return MaskPlan(fills=[("grammar", index, list(drafts))])

    @property
    def is_stopped(self):
        return self.accepted[-2:] == [5, 5]


def test_gate_starts_the_grammar_after_the_end_sequence():
    g = FakeGrammar()
    gate = ReasoningGate(g, end_ids=[7, 8], start_id=6, inside=True)
    assert gate.mask_plan(0, ()).fills == []  # thinking: every token allowed
    for t in (1, 7, 2, 7):
        assert gate.accept(t)
    assert gate.state == IN and g.accepted == []
    # drafts [8, 3]: the end sequence completes with 8, the grammar masks from there on
    assert gate.mask_plan(10, (8, 3)).fills == [("grammar", 11, [3])]
    assert gate.valid_prefix((8, 99, 3)) == 1
    assert gate.accept(8) and gate.state == AFTER and not gate.is_stopped
    assert not gate.accept(99)  # the grammar's refusal is the gate's
    assert gate.accept(5) and gate.accept(5) and gate.is_stopped
    assert gate.mask_plan(3, (4,)).fills == [("grammar", 3, [4])]
    gate.rewind_to(6)  # the grammar keeps its first token
    assert gate.state == AFTER and g.accepted == [99] and gate.num_tokens == 6
    gate.rewind_to(4)  # back before the end sequence completed: thinking again
    assert gate.state == IN and g.accepted == [] and gate.num_tokens == 4
    assert gate.accept(8) and gate.state == AFTER


def test_gate_may_open_a_block_itself():
    g = FakeGrammar()
    gate = ReasoningGate(g, end_ids=[8], start_id=6, inside=False)
    plan = gate.mask_plan(2, ())
    assert plan.fills == [("grammar", 2, [])] and plan.allow == [(2, 6)]
    assert gate.accept(4) and gate.state == AFTER and g.accepted == [4]  # no block: grammar
    gate.rewind_to(0)
    assert gate.state == BEFORE and g.accepted == []
    assert gate.accept(6) and gate.state == IN and g.accepted == []  # a block opened


def test_bad_words_follow_vllm():
    vocab = {"bad": [5], " bad": [6], "two words": [7, 8], " two words": [9, 8]}
    ids = bad_word_ids(["bad", " two words"], lambda w: vocab[w])
    assert ids == [(5,), (6,), (7, 8), (9, 8)]
    mask = BadWordsMask(ids)
    assert mask.sequences == ((7, 8), (9, 8))
    assert mask.mask_plan(0, ()).ban == []
    mask.accept(7)
    assert mask.mask_plan(4, (1, 9)).ban == [(4, 8), (6, 8)]  # after 7, and after ... 9
    assert mask.valid_prefix((8,)) == 0 and mask.valid_prefix((1, 8)) == 2
    mask.rewind_to(0)
    assert mask.mask_plan(0, ()).ban == []
    both = stack(FakeGrammar(), mask)
    assert both.accept(7) and both.mask_plan(0, ()).ban == [(0, 8)]
    assert stack(None, None) is None and stack(mask, None) is mask
