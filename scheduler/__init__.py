"""Pure host-side step planning for arcjax.

Imports only the standard library: no JAX, no clocks (time is an argument), no randomness, no I/O,
and nothing here mutates its inputs. One engine step:

  1. plan = schedule(state, config)              which tokens of which sequences run now
  2. the engine runs plan's rows and samples      (outside this package)
  3. state, finished = commit(plan.state, plan, sampled_token_ids, now, finished_ids)

Overlapped: `advance(plan.state, plan)` folds a step in flight in with placeholder tokens, the
next step is planned from it, and `commit` of the first plan then fills the tokens in
(scheduler/commit.py).

Speculative decoding: `schedule(state, config, spec_token_ids={request id: drafts})` lets decode
rows verify draft tokens with what the step leaves over (`plan.spec_token_ids`), and `commit`
takes, for such a row, the 1 .. 1 + drafts tokens it yielded (scheduler/spec.py).

Requests enter with add_request(state, Request(...)) and leave through commit or abort.
Automatic prefix caching (config.enable_prefix_caching, on by default) lives in scheduler/prefix.py:
plan.num_cached / Finished.num_cached_tokens / state.num_cached(request_id) say how many prompt
tokens the cache served; state.pool.num_free counts blocks usable for new allocations (free plus
cached-unreferenced) and state.pool.num_in_use the blocks live sequences hold.
With config.sliding_window (a model whose every layer slides), blocks behind every running
sequence's window return to the pool when a step is planned (scheduler/window.py).
"""

from scheduler.arms import ARM_KEYS, KNOB_SHORT, Arm, parse_arm
from scheduler.blocks import BlockPool, blocks_for
from scheduler.commit import abandon, advance, commit, forget_prefix_cache
from scheduler.scheduler_config import POLICIES, SchedulerConfig
from scheduler.scheduler_errors import CommitError, ConfigError, DuplicateRequestError, InputError, RequestError
from scheduler.scheduler_errors import RequestTooLargeError, StepOrderError, UnknownRequestError
from scheduler.step_plan import Chunk, Engaged, StepPlan
from scheduler.policies import schedule
from scheduler.request import FINISH_LENGTH, FINISH_STOP, Finished, Request, RequestId
from scheduler.state import PLACEHOLDER, SchedulerState, abort, add_request, validate_request

__all__ = [
    "ARM_KEYS", "Arm", "BlockPool", "Chunk", "CommitError", "ConfigError", "DuplicateRequestError",
    "Engaged", "FINISH_LENGTH", "FINISH_STOP", "Finished", "InputError", "KNOB_SHORT",
    "PLACEHOLDER", "POLICIES", "Request", "RequestError", "RequestId", "RequestTooLargeError",
    "SchedulerConfig", "SchedulerState", "StepOrderError", "StepPlan", "UnknownRequestError",
    "abandon", "abort", "add_request", "advance", "blocks_for", "commit", "forget_prefix_cache",
    "parse_arm", "schedule", "validate_request",
]
