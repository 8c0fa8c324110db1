"""Grammar matchers (llguidance): compile a constraint, cache it, advance it, fill masks.

1. `GrammarCompiler(tokenizer_json, vocab_size, eos_token_ids)`: one per engine. On first
   use it builds llguidance's view of the tokenizer (once; ~1 s for a 150k vocabulary),
   then compiles each `StructuredOutputsParams` into a matcher *template*, cached by the
   constraint's canonical text (`StructuredOutputsParams.key()`, LRU). A constraint that
   does not compile raises `StructuredOutputsError` naming its field, at submission.
2. `compiler.matcher(params)`: a `RequestGrammar`, a private copy of the template
   (`deep_copy`, microseconds): one per request (per sample with n > 1).
3. Each step, `MaskFiller.fill(rows, size)` writes the packed bitmask of every constrained
   row, `[size, ceil(vocab / 32)]` int32 (bit t of word t // 32 set = token t allowed),
   every other row all ones, from each row's `MaskSource.mask_plan` (`mask_source.py`: a
   grammar, a grammar behind a reasoning gate, bad words); llguidance computes the
   grammars' rows on its own threads, without the GIL. The jitted step applies the mask to
   the logits (`runtime/sampling.py`).
4. Every committed token advances its request's matcher (`accept`); a step rolled back
   rolls it back (`rollback`). A matcher that is stopped allows only EOS: the engine then
   finishes the request with "stop".

NOTE: the matcher follows the committed tokens only. Preemption keeps a request's
generated tokens (they are recomputed, not resampled), so it leaves the matcher as it is.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np

from arcjax.errors import StructuredOutputsError
from arcjax.runtime.sampling import bitmask_words
from arcjax.sampling_params import StructuredOutputsParams
from arcjax.structured.mask_source import MaskPlan, MaskSource

CACHE_SIZE = 256  # compiled templates kept (each holds its lexer: KBs to a few MBs)
# JSON whitespace between two tokens when the request does not say: at most one space or
# newline. Bounded (llama.cpp and Outlines bound it too), so a schema with bounded values
# bounds the output: unbounded whitespace lets a model pad JSON until max_tokens.
DEFAULT_WHITESPACE = r"[ \n]"


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (not yet checked: compiling checks it).

    Raises:
      StructuredOutputsError: a GBNF grammar that cannot be converted.
    """
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = (DEFAULT_WHITESPACE if params.whitespace_pattern
                                             is None else params.whitespace_pattern)
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(params.choice))
    try:  # Lark, or GBNF (converted)
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise StructuredOutputsError(params.field, f"cannot be parsed: {e}") from None


class RequestGrammar(MaskSource):
    """One request's matcher, advanced by its committed tokens (stepping thread only)."""

    def __init__(self, matcher, field: str):
        self.matcher = matcher
        self.field = field
        self.num_tokens = 0  # tokens accepted so far

    def accept(self, token: int) -> bool:
        """Advances by one committed token. False if the grammar rejects it (the matcher is
        then in an error state for good: the request cannot go on)."""
        if not self.matcher.consume_token(int(token)):
            return False
        self.num_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forgets the newest `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def rewind_to(self, num_tokens: int) -> None:
        """Rolls back to the state after `num_tokens` accepted tokens."""
        self.rollback(self.num_tokens - num_tokens)

    def valid_prefix(self, tokens) -> int:
        """How many of `tokens` (draft tokens) the grammar accepts in a row from here; the
        matcher is left as it was."""
        return self.matcher.validate_tokens([int(t) for t in tokens])

    def mask_plan(self, index: int, drafts) -> MaskPlan:
        return MaskPlan(fills=[(self.matcher, int(index), [int(t) for t in drafts])])

    @property
    def is_stopped(self) -> bool:
        """True when the grammar admits no more text (only EOS is allowed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" when it has not)."""
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches them (thread-safe: requests are
    validated in the submitting thread)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 *, cache_size: int = CACHE_SIZE):
        """Args:
          tokenizer_json: the model's `tokenizer.json` text (Hugging Face tokenizers).
          vocab_size: the model's logits width (may exceed the tokenizer's: the extra ids
            are never allowed).
          eos_token_ids: the ids that end a request; allowed where the grammar may end.
        """
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self._templates: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (not found in the cache)

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size,
                        eos_token=list(self.eos_token_ids) or None)
                except Exception as e:  # noqa: BLE001  llguidance raises plain errors
                    raise StructuredOutputsError(
                        "structured_outputs", f"this model's tokenizer cannot drive a "
                                              f"grammar ({e})") from None
            return self._ll_tokenizer

    def template(self, params: StructuredOutputsParams):
        """The compiled matcher template of `params` (from the cache, or compiled now).

        Raises:
          StructuredOutputsError: the constraint does not compile (names its field).
        """
        key = params.key()
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                return found
        import llguidance

        tokenizer = self._tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise StructuredOutputsError(params.field, f"cannot be compiled into a grammar: "
                                                       f"{matcher.get_error()}")
        with self._lock:
            self.compiles += 1
            self._templates[key] = matcher
            while len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request.

        Raises:
          StructuredOutputsError: the constraint does not compile (names its field).
        """
        template = self.template(params)
        with self._lock:
            copy = template.deep_copy()
        return RequestGrammar(copy, params.field)

    def __len__(self) -> int:
        return len(self._templates)


class MaskFiller:
    """Fills packed bitmasks on llguidance's thread pool (one per engine)."""

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._num_threads = num_threads
        self._executor = None  # its threads start on first use

    def fill(self, rows: Sequence[tuple], size: int) -> np.ndarray:
        """The bitmask of one step: `rows` are (index, source) or (index, source, drafts) of
        the constrained rows (a `MaskSource` each); every other of the `size` rows is all
        ones. A row with draft tokens (speculative decoding) gets len(drafts) + 1 masks, at
        index .. index + len(drafts): the source's state after the drafts before each; a
        grammar's up to the first draft it refuses (the positions after it stay all ones:
        verification rejects that draft, so they are never yielded). Returns [size, words]
        int32."""
        import llguidance.numpy as llnp

        mask = np.full((size, self.words), -1, np.int32)
        plan = MaskPlan()
        for row in rows:
            plan.extend(row[1].mask_plan(int(row[0]), row[2] if len(row) > 2 else ()))
        if plan.fills:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(self._num_threads)
            drafted = [f for f in plan.fills if f[2]]
            plain = [(m, i) for m, i, d in plan.fills if not d]
            if drafted:  # (llguidance refuses an empty draft list)
                llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
            if plain:
                llnp.fill_next_token_bitmask_par(self._executor, plain, mask)
        for position, token in plan.allow:
            mask[position, token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        for position, token in plan.ban:
            mask[position, token >> 5] &= np.int32(np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF
                                                             ).view(np.int32))
        return mask


class StructuredOutputManager:
    """An engine's structured outputs: the compiler (built on first use: most engines never
    see a constrained request) and the mask filler.

    Attributes:
      compiler: the `GrammarCompiler`, or None until the first constrained request.
      filler: the `MaskFiller` (replaceable, e.g. by a timing wrapper in benchmarks).
    """

    def __init__(self, tokenizer_json: Callable[[], str] | None, vocab_size: int,
                 eos_token_ids: Sequence[int]):
        """Args:
          tokenizer_json: returns the model's `tokenizer.json` text (None: the model has
            no tokenizer, and structured outputs are refused).
          vocab_size, eos_token_ids: the model's logits width and its EOS ids.
        """
        self._tokenizer_json = tokenizer_json
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self.compiler: GrammarCompiler | None = None
        self.filler = MaskFiller(vocab_size)
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        """Compiles `params` (or finds it in the cache): the check at submission.

        Raises:
          StructuredOutputsError: the model has no tokenizer, or the constraint does not
            compile (names its field).
        """
        self._compiler().template(params)

    def grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request (compiled or found in the cache); raises as
        `check`."""
        return self._compiler().matcher(params)

    def _compiler(self) -> GrammarCompiler:
        with self._lock:
            if self.compiler is None:
                if self._tokenizer_json is None:
                    raise StructuredOutputsError("structured_outputs", "needs the model's "
                                                 "tokenizer (tokenizer.json): this model "
                                                 "has none")
                self.compiler = GrammarCompiler(self._tokenizer_json(), self.vocab_size,
                                                self.eos_token_ids)
            return self.compiler

    def bitmask(self, rows: Sequence[tuple], size: int) -> np.ndarray | None:
        """The bitmask of a step's `size` sampled positions ((index, grammar[, drafts]) of
        the constrained rows, as `MaskFiller.fill`), or None when no row is constrained
        (the runner then uses its all-ones mask)."""
        return self.filler.fill(rows, size) if rows else None
