"""The row contract: what the ingress hands the replica for one completion (`RowSpec`), and the
one rule for which rows share a running lane (`mtp_batch_compatibility_key`). Plain Python, no
MLX; built once from the request, carried ingress -> replica -> scheduler unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mtplx.sampling import SamplerConfig
from mtplx.structured import Constraint

GENERATION_MODES = ("auto", "mtp", "ar")


def mtp_batch_compatibility_key(model_id: Optional[str], omit_speculative_bonus: bool = False,
                                sampler: Optional[SamplerConfig] = None,
                                draft_sampler: Optional[SamplerConfig] = None,
                                generation_mode: str = "mtp") -> tuple:
    """The compatibility key, the one rule for which rows share a running lane: the model, and
    nothing of the request's sampling route. It takes the route's parts (MTPLX's signature) to
    say, for each, why it stays out: every one travels with its row, and the lane acts on it per
    row in the same forwards.

    - sampler and draft sampler (temperature, top_p, top_k, min_p, penalties): each row draws
      from its own distributions with its own RNG; greedy rows keep the argmax (a point mass).
      A lane chains deeper drafts only while all its drafting rows are greedy
      (``RunningLane.greedy_ladder``), so a sampled row's draws never depend on its neighbours.
      Greedy and sampled rows share one lane: with mixed settings, lanes split by greedy/sampled
      took turns at a third fewer rows a cycle (README, "Mixed sampling settings in one lane").
    - omit-bonus flag: a row keeps or drops its own bonus token.
    - generation mode: a row's ``speculative`` / ``adaptive`` flags; a row that does not draft
      keeps one target token per cycle (AR's draws) in an MTP cycle.
    - seed, stop sets, logprobs, ``n`` siblings: the row's own.
    - constraint (a JSON schema, regex, grammar, tool-call format, thinking budget): the row's
      own grammar state masks its own distributions, drafts and verified positions alike.

    Only the model stays: rows of different weights cannot share a forward.
    """
    return (model_id,)


def speculation(generation_mode: str) -> tuple:
    """A generation mode as the engine's row flags (speculative, adaptive): "mtp" always drafts,
    "ar" never, "auto" drafts while its drafts pay (the row's own acceptance)."""
    if generation_mode not in GENERATION_MODES:
        raise ValueError(f"generation_mode={generation_mode!r}: expected one of {GENERATION_MODES}")
    return generation_mode != "ar", generation_mode == "auto"


@dataclass(frozen=True)
class RowCheckpoint:
    """A live row's state after its first `tokens` tokens, as the replica streams it beside them
    (the engine's `RowMark` in plain values): whether its last token is still to be fed, its RNG
    state (numpy's PCG64 state dict; None for a greedy row) and its drafting policy. With the
    row's prompt and those tokens it re-admits the row on any replica, continuing with the draws
    it would have made (`RowSpec.resume_tokens`)."""

    tokens: int
    pending: bool
    rng_state: Optional[dict]
    policy: tuple           # (acceptance estimate, drafting, probe period, cycles to the next probe)


@dataclass(frozen=True)
class RowSpec:
    """One completion row as the scheduler needs it: prompt, budget, sampling, stops, logprobs.
    `stop_token_ids` and `stop_strings` are the request's own; the model's EOS joins them at the replica unless
    `ignore_eos`. `prefill_group`: rows of one request (n > 1) that share one prefill.
    `resume_tokens`: a row re-admitted after the replica running it went away continues after
    these tokens (already streamed to its client), from `checkpoint` (its state after them, as
    the replica streamed it; None: unknown, and a sampled row continues with fresh draws from
    its seed at that position). Its `max_tokens` counts them."""

    request_id: str
    model: str
    prompt_ids: tuple
    max_tokens: int
    sampler: SamplerConfig
    seed: int
    generation_mode: str = "auto"
    draft_sampler: Optional[SamplerConfig] = None
    omit_speculative_bonus: bool = False
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    min_tokens: int = 0                     # the row's stop tokens and strings are held back until it has this many
    stop_strings: tuple = ()                # matched on its text at the replica (`StopStringWatch`)
    skip_special_tokens: bool = True        # how that text is detokenized: as its client's text
    logprobs: Optional[int] = None          # None, or the alternatives per token (0-20)
    prefill_group: Optional[str] = None
    constraint: Optional[Constraint] = None   # structured output: checked at the ingress, enforced per row
    # per-caller state, as digests (never an API key): who may cancel the row, and the prefix
    # cache's partition (the caller's key and the request's cache_salt) its prompt is looked up in
    owner: Optional[str] = None
    cache_salt: Optional[str] = None
    resume_tokens: tuple = ()
    checkpoint: Optional[RowCheckpoint] = None

    def __post_init__(self):
        speculation(self.generation_mode)    # a bad mode fails here, where the row is built

    @property
    def compatibility_key(self) -> tuple:
        return mtp_batch_compatibility_key(self.model)

    @property
    def speculative(self) -> bool:
        return speculation(self.generation_mode)[0]

    @property
    def adaptive(self) -> bool:
        return speculation(self.generation_mode)[1]
