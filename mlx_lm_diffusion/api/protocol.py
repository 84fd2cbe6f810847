"""The step-schedule protocol (shared/seeds/004): InferenceRequest in, InferenceResponse out.

`run_request(model, tokenizer, request)` validates the request against the spec's JSON
schema, decodes it through the shared engine (one block over the whole generation,
the schedule's quota per step, a temperature per step, nucleus top_p) and returns a
response that validates against the spec's response schema.

Corrections to the spec, each deliberate:
- Its request schema declares draft-07 but writes top_p's bound in draft-04 form
  (`"exclusiveMinimum": true`), which a draft-07 validator reads as a bound of 1 and so
  rejects every top_p. Here: `"exclusiveMinimum": 0, "maximum": 1`, i.e. 0 < top_p <= 1.
- The schedule counts (see `schedules`): positions still masked after step t are
  floor(M * gamma((t + 1) / N)), so the canvas is full after N steps.
- Extension `confidence_threshold` (optional, in (0, 1]): after a step's scheduled
  commit, when every position still masked is predicted with at least this
  confidence, all of them are committed at once and the reason is
  "confidence_threshold_met".
- Extension `seed_canvas` (optional, target_length ids): the canvas to start from. Its
  first entries are prompt_tokens; after them the model's mask id marks a free
  position and any other id a pinned one (infilling, mlx_lm_diffusion.output.infill): pinned
  tokens are never changed, are in final_tokens as given, are never listed in
  per_step_unmasked and have confidence 1; the schedule counts the free positions only.
  Families that cannot attend to text after the current block refuse pinned positions.
- Extension `images` (optional, DiffusionGemma with a vision tower): images as data:
  URLs, read under the server's image rules and limits (mlx_lm_diffusion.media.images). Each
  image is one image token (the processor's image_token_id) in prompt_tokens, where the
  image goes; the decode expands it into the image's soft tokens, and the response
  keeps the request's positions (final_tokens begins with prompt_tokens as given).
- DiffusionGemma (no mask token, a uniform-noise canvas): uniform noise plays the mask's
  part (decoders/uniform_canvas.py, its committing mode): each step the model sees the
  committed tokens and fresh noise elsewhere, the schedule's k_t most confident open
  positions are committed with their drawn token, temperature_schedule and top_p as
  specified. seed_canvas, which marks free positions with the mask token, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional

import jsonschema
import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.api.decode import Decode, build_decode
from mlx_lm_diffusion.decoding import FREE, GAMMAS, Engine, Quota, ScheduleQuota, Step, StepInputs, schema
from mlx_lm_diffusion.media import images as image_inputs
from mlx_lm_diffusion.output.infill import check_seed
from model_adapters import adapter_for

REQUEST_SCHEMA: dict = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "InferenceRequest",
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "target_length": {"type": "integer"},
        "num_steps": {"type": "integer", "minimum": 1},
        "mask_schedule": {"type": "string", "enum": sorted(GAMMAS)},
        "temperature_schedule": {"type": "array", "items": {"type": "number", "minimum": 0.0}},
        "top_p": {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0},  # draft-07 form
        "confidence_threshold": {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0},
        "seed": schema()["seed"].json_schema(),  # extension fields, from the options schema
        "cache": schema()["cache"].json_schema(),  # (LLaDA and Dream: Fast-dLLM's caches)
        "self_spec": schema()["self_spec"].json_schema(),  # (Nemotron: refused below, it has no schedule)
        "seed_canvas": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "images": {"type": "array", "items": {"type": "string", "minLength": 1}},
    },
    "required": [
        "prompt_tokens",
        "target_length",
        "num_steps",
        "mask_schedule",
        "temperature_schedule",
        "top_p",
    ],
}

RESPONSE_SCHEMA: dict = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "InferenceResponse",
    "type": "object",
    "properties": {
        "final_tokens": {"type": "array", "items": {"type": "integer"}},
        "per_step_unmasked": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "step": {"type": "integer"},
                    "token_indices": {"type": "array", "items": {"type": "integer"}},
                    "unmasked_tokens": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["step", "token_indices", "unmasked_tokens"],
            },
        },
        "confidence": {"type": "array", "items": {"type": "number", "minimum": 0.0, "maximum": 1.0}},
        "termination_reason": {
            "type": "string",
            "enum": ["max_steps_reached", "fully_unmasked", "confidence_threshold_met"],
        },
    },
    "required": ["final_tokens", "per_step_unmasked", "confidence", "termination_reason"],
}


def validate_request(request: Any) -> None:
    """Raise ValueError carrying the first schema violation (or a semantic one)."""
    validator = jsonschema.Draft7Validator(REQUEST_SCHEMA)
    error = jsonschema.exceptions.best_match(validator.iter_errors(request))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "request"
        raise ValueError(f"invalid InferenceRequest at {where}: {error.message}")
    if request["target_length"] <= len(request["prompt_tokens"]):
        raise ValueError(
            f"target_length ({request['target_length']}) must exceed the prompt length "
            f"({len(request['prompt_tokens'])})"
        )
    if not request["prompt_tokens"]:
        raise ValueError("prompt_tokens must hold at least one token")
    seed = request.get("seed_canvas")
    if seed is not None and (
        len(seed) != request["target_length"] or seed[: len(request["prompt_tokens"])] != request["prompt_tokens"]
    ):
        raise ValueError("seed_canvas must hold target_length ids and begin with prompt_tokens")
    if len(request["temperature_schedule"]) != request["num_steps"]:
        raise ValueError(
            f"temperature_schedule has {len(request['temperature_schedule'])} values; "
            f"num_steps is {request['num_steps']}: give one temperature per step"
        )


@dataclass
class ScheduleWithEarlyExit(ScheduleQuota):
    """The protocol's selection plus the `confidence_threshold` extension."""

    confidence_threshold: Optional[float] = None
    threshold_met: bool = False
    name: ClassVar[str] = "protocol"
    # the schedule covers every generated position: a family that seeds each block's first
    # token from a causal pass (Nemotron) does not, the model's block forward predicts it
    # as every other (the spec's contract: logits for every masked position)
    seeds_blocks: ClassVar[bool] = False
    # step -> (B, block) commits, for a canvas without mask ids to compare (uniform noise)
    commits: dict = field(default_factory=dict)

    def known_commits(self, state: Quota, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        if self.confidence_threshold is not None:
            return None  # the early exit depends on the step's confidences
        return super().known_commits(state, step, steps, masked)

    def select(self, s: StepInputs, state: Quota) -> mx.array:
        commit = self.commits[s.step] = self._select(s, state)
        return commit

    def _select(self, s: StepInputs, state: Quota) -> mx.array:
        commit = super().select(s, state)
        if self.confidence_threshold is None:
            return commit
        rest = mx.logical_and(s.candidates, mx.logical_not(commit))
        unsure = mx.logical_and(rest, s.prob < self.confidence_threshold)
        if mx.any(rest).item() and not mx.any(unsure).item():
            self.threshold_met = True
            return s.candidates
        return commit


def run_request(
    model,
    tokenizer,
    request: dict,
    max_forwards: Optional[int] = None,
    on_step: Optional[Callable[[Step], None]] = None,
    processor: Any = None,
    image_policy: Optional[image_inputs.ImagePolicy] = None,
    validated: bool = False,
) -> dict:
    """Decode one InferenceRequest; returns an InferenceResponse (a dict). A request that
    could take more than `max_forwards` forwards is refused (ValueError) before it runs;
    `on_step` sees every step and may raise to stop the decode (a server's cancellation).
    `images` need the checkpoint's processor (`processor`, or `tokenizer` when it is one)
    and are read under `image_policy` (default: data: URLs only, the server's limits).
    `validated`: the caller ran validate_request on this request already (a server does,
    before it waits for the model)."""
    decode = prepare_request(model, tokenizer, request, max_forwards, processor, image_policy, validated)
    engine = Engine(decode.adapter, decode.options, keep_logprobs=False, vision=decode.vision)
    steps = engine.run(mx.array([decode.prompt]), decode.seed)
    return decode.response(steps if on_step is None else _watched(steps, on_step))


def _watched(steps, on_step: Callable[[Step], None]):
    for step in steps:
        on_step(step)
        yield step


@dataclass
class ProtocolDecode:
    """A validated InferenceRequest, ready to decode: its `Decode` (build_decode's, as every
    door's: its adapter; its resolved options, with ignore_eos: the protocol fills
    target_length; its prompt, seed canvas's pinned tokens and forward bound), the canvas it
    starts from and its schedule's rule; `response` builds the InferenceResponse from the
    decode's steps (Engine.run's, or a batch row's: mlx_lm_diffusion.serving.scheduler).
    With images, `prompt` holds their soft tokens and `given` the request's own
    prompt_tokens (the response keeps the request's positions)."""

    decode: Decode
    start: np.ndarray  # (1, len(prompt) + generated) the canvas the decode starts from
    rule: "ScheduleWithEarlyExit"
    steps: int
    given: Optional[list] = None  # the request's prompt_tokens (None: `prompt`)

    @property
    def adapter(self) -> Any:
        return self.decode.adapter

    @property
    def options(self) -> Any:
        return self.decode.options

    @property
    def prompt(self) -> list:
        return self.decode.ids

    @property
    def seed(self) -> Optional[np.ndarray]:
        return self.decode.seed

    @property
    def vision(self) -> Any:
        """The images' vision inputs, encoded with the prompt (DiffusionGemma), or None."""
        return self.decode.vision

    @property
    def uniform(self) -> bool:
        """No mask ids to compare (DiffusionGemma): the rule's own record of each step's commits."""
        return self.adapter.mask_id is None

    def response(self, steps) -> dict:
        mask_id, P = self.adapter.mask_id, len(self.prompt)
        given = self.prompt if self.given is None else self.given
        shift = P - len(given)  # the soft tokens the images' placeholders became
        trace, last, previous = [], None, self.start
        for last in steps:
            if self.uniform:
                done = self.rule.commits.pop(last.step, None) if last.ran_forward else None
                newly = np.array([], dtype=np.int64) if done is None else np.flatnonzero(np.array(done)[0]) + P
            else:
                newly = np.flatnonzero((previous[0] == mask_id) & (last.canvas[0] != mask_id))
            if newly.size:
                trace.append(
                    {
                        "step": last.step,
                        "token_indices": (newly - shift).tolist(),
                        "unmasked_tokens": last.canvas[0, newly].tolist(),
                    }
                )
            previous = last.canvas
        if self.rule.threshold_met:
            reason = "confidence_threshold_met"
        elif last.forwards >= self.steps:
            reason = "max_steps_reached"
        else:
            reason = "fully_unmasked"
        confidence = np.clip(np.array(last.block_confidence[0], dtype=np.float64), 0.0, 1.0)
        if self.seed is not None:  # a pinned token is certain
            confidence = np.where(self.seed[0] != FREE, 1.0, confidence)
        return {
            "final_tokens": list(given) + last.canvas[0, P:].tolist(),
            "per_step_unmasked": trace,
            "confidence": confidence.tolist(),
            "termination_reason": reason,
        }


def prepare_request(
    model,
    tokenizer,
    request: dict,
    max_forwards: Optional[int] = None,
    processor: Any = None,
    image_policy: Optional[image_inputs.ImagePolicy] = None,
    validated: bool = False,
) -> ProtocolDecode:
    """Validate an InferenceRequest (unless `validated`) and resolve its decode (ValueError /
    ValidationError on a bad one, before anything runs; its images read in full)."""
    if not validated:
        validate_request(request)
    if request.get("self_spec"):
        raise ValueError(
            "self_spec decodes greedily by its own windows, not by a mask schedule: the "
            "step-schedule protocol cannot drive it; use the completions endpoints"
        )
    adapter = adapter_for(model, tokenizer)
    uniform = adapter.mask_id is None and adapter.decoder == "uniform_canvas"
    if adapter.mask_id is None and not uniform:
        raise ValueError(f"{adapter.family} has no mask token; the step-schedule protocol needs one")
    if uniform and "seed_canvas" in request:
        raise ValueError(
            f"seed_canvas marks free positions with the mask token; {adapter.family} has "
            "none (its canvas is uniform noise): drop seed_canvas"
        )
    given = [int(t) for t in request["prompt_tokens"]]
    if adapter.mask_id in given or max(given) >= adapter.vocab_size:
        raise ValueError("prompt_tokens must be vocabulary ids other than the mask token")
    prompt, vision = given, None
    if request.get("images"):  # read in full before anything runs
        processor = processor if processor is not None else tokenizer
        prompt, vision = image_inputs.protocol_prompt(model, processor, given, request["images"], image_policy)
    shift = len(prompt) - len(given)  # the soft tokens the images' placeholders became
    P, total, steps = len(prompt), int(request["target_length"]) + shift, int(request["num_steps"])
    if adapter.max_length is not None and total > adapter.max_length:  # the engine would cap it
        raise ValueError(
            f"target_length ({request['target_length']}) exceeds the model's context of "
            f"{adapter.max_length} tokens{' with the images' if shift else ''}; lower it"
        )
    rule = ScheduleWithEarlyExit(request["mask_schedule"], request.get("confidence_threshold"))
    start = np.array([request.get("seed_canvas") or prompt + [adapter.mask_id] * (total - P)])
    seed = check_seed(adapter, start[:, P:], adapter.mask_id) if "seed_canvas" in request else None
    decode = build_decode(
        model,
        tokenizer,
        prompt,
        total - P,
        adapter=adapter,
        max_forwards=max_forwards,
        vision=vision,
        # one block: the whole generated region, which the schedule unmasks. A family whose
        # blocks sit on absolute positions (align_blocks) takes a block of the canvas's own
        # length: its one aligned block [0, total) is that region (a block of total - P would
        # split it at a multiple of total - P and run past target_length)
        block_length=total if adapter.align_blocks else total - P,
        steps=steps,
        strategy=rule,
        temperature_schedule=request["temperature_schedule"],
        top_p=request["top_p"],
        seed=request.get("seed"),
        cache=request.get("cache"),
        ignore_eos=True,  # the protocol fills target_length
        # the protocol's contract: its schedule decides every commit and no token is edited
        # (a family with token edits on by default, LLaDA2.2's, is asked for none)
        **({"edit_ops": ()} if any(o.name == "edit_ops" for o in adapter.options) else {}),
    )
    # (the seed canvas pins tokens where it likes: the Decode's pinned tokens, not a suffix's)
    return ProtocolDecode(replace(decode, seed=seed), start, rule, steps, given)


def validate_response(response: dict) -> None:
    jsonschema.Draft7Validator(RESPONSE_SCHEMA).validate(response)
