"""Single-request decoding: plain autoregressive (`generate_ar`) and MTP speculative decoding
(`generate_mtpk`), both as a one-row lane (`mtplx.engine.lane.RunningLane`): one decode engine
for solo and batched rows, the same prefill partition (the prompt body in chunks, then its last
token alone), the same draws in the same order. An AR row keeps the target's next token each
step; an MTP row runs cycles of depth K:
  primary x0 (pending from the last cycle, or sampled from the last logits)
  -> K chained drafts from the MTP head
  -> one target verify forward over [x0, d1..dK]
  -> drafts judged left to right (`mtplx.engine.acceptor`); the first rejection emits the
     residual sample; if all are kept a bonus token comes from the last verify position
  -> the target KV of the kept positions stays; the head's history keeps target hiddens only.
RNG order per cycle: primary, drafts, accept draws/residual, bonus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from mtplx.end import End
from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.installed import DEPTHS, solo_lane
from mtplx.engine.prefill import check_request
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.sampling import SamplerConfig


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str                  # "stop" | "length" | "cancelled": its End's coarse reason
    stats: dict = field(default_factory=dict)
    end: Optional[End] = None           # how it ended (`mtplx.end`)


def generate_ar(model, prompt_ids, max_tokens: int = 64, sampler: SamplerConfig = SamplerConfig(),
                seed: int = 0, stop_token_ids: Iterable[int] = frozenset(), on_token=None) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token (a one-row lane row that never
    drafts)."""
    prompt = check_request(model, prompt_ids, max_tokens)
    return _generate_in_lane(model, prompt, max_tokens, sampler, None, 1, seed, stop_token_ids, False, on_token,
                             None, None, speculative=False)


def generate_mtpk(model, prompt_ids, max_tokens: int = 64, sampler: SamplerConfig = SamplerConfig(),
                  draft_sampler: Optional[SamplerConfig] = None, depth: int = 1, seed: int = 0,
                  stop_token_ids: Iterable[int] = frozenset(), omit_speculative_bonus: bool = False,
                  on_token=None, session_restore=None, session_commit=None,
                  draft_draw: Optional[str] = None) -> GenerationResult:
    """MTP speculative decoding with the model's own head (depth 1-3). Exact: greedy output equals
    `generate_ar`; sampled output keeps the target distribution. `draft_draw`: where sampled drafts
    are drawn ("device" | "host"; None: `EngineSettings`' default)."""
    if model.mtp is None:
        raise ValueError(f"this model has no MTP head ({model.mtp_disabled_reason}); use generate_ar")
    if int(depth) not in DEPTHS:
        raise ValueError(f"depth={depth} is invalid: must be 1, 2 or 3")
    prompt = check_request(model, prompt_ids, max_tokens)
    return _generate_in_lane(model, prompt, max_tokens, sampler, draft_sampler or sampler, int(depth), seed,
                             stop_token_ids, omit_speculative_bonus, on_token, session_restore, session_commit,
                             draft_draw=draft_draw)


def _generate_in_lane(model, prompt, max_tokens, sampler, draft_sampler, depth, seed, stop_token_ids,
                      omit_speculative_bonus, on_token, session_restore, session_commit,
                      speculative: bool = True, draft_draw: Optional[str] = None) -> GenerationResult:
    """A one-row cohort of the lane chaining `depth` drafts (or none: `speculative` False)."""
    errors = []

    def forward_token(token):
        try:
            on_token(token)
        except BaseException as exc:  # surface the caller's own exception, not a cancelled row
            errors.append(exc)
            raise

    req = A3BMTPBatchRequest(
        request_id="solo", prompt_ids=prompt, sampler=sampler, draft_sampler=draft_sampler, seed=seed,
        max_tokens=int(max_tokens), stop_token_ids=frozenset(stop_token_ids),
        omit_speculative_bonus=omit_speculative_bonus, speculative=speculative,
        on_token=forward_token if on_token is not None else (lambda _t: None),
        session_restore=session_restore, session_commit=session_commit)
    t_start = time.perf_counter()
    res = generate_a3b_mtp_batch(solo_lane(model, depth), [req], draft_draw=draft_draw)
    if errors:
        raise errors[0]
    s = res.streams[0]
    n = len(s.tokens)
    decode_s = max(s.terminal_perf_s - (t_start + res.prefill_s), 1e-9)
    elapsed = max(s.terminal_perf_s - t_start, 1e-9)
    stats = {
        "prompt_tokens": len(prompt), "completion_tokens": n, "prompt_eval_time_s": res.prefill_s,
        "decode_elapsed_s": decode_s, "decode_tok_s": n / decode_s, "elapsed_s": elapsed,
        "end_to_end_tok_s": n / elapsed, "cached_tokens": s.cached_tokens,
    }
    if not speculative:
        stats.update(mode="ar", generation_mode="ar", verify_calls=0)
        return GenerationResult(list(s.tokens), s.finish_reason, stats, s.end)
    stats.update({
        "mode": "mtp", "generation_mode": "mtp", "mtp_depth": depth, "accepted_drafts": s.accepted_drafts,
        "rejected_drafts": s.rejected_drafts, "verify_calls": s.cycles,
        "acceptance_rate": s.accepted_drafts / max(s.accepted_drafts + s.rejected_drafts, 1),
        "mean_tokens_per_verify": n / max(s.cycles, 1),
    })
    return GenerationResult(list(s.tokens), s.finish_reason, stats, s.end)
