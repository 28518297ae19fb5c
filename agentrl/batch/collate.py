"""Trajectories <-> the trainer's batch: the one place where padding is decided.

Why it exists: the trainer sees one padded batch (DESIGN section 3), never lists of
trajectories. :func:`trajectories_to_batch` builds it in the layout of
:data:`agentrl.batch.schema.BATCH_SCHEMA` (``B`` trajectories, ``P`` = longest prompt, left
padded; ``R`` = longest response, right padded; ``input_ids`` = cat(prompts, responses);
``position_ids`` = cumsum(attention_mask) - 1, clipped at 0; ``uid``, ``agent``,
``data_source`` as one string per row that slices with the batch) and checks it against the
schema before returning it.

Reward placement: the episode ``reward`` sits on the last sampled token (``loss_mask == 1``) of
the response; a response with no sampled token puts it on its last token (an empty response:
on column 0, which is padding, so it counts in group statistics but trains nothing); with
``turn_rewards``, reward k is added on the last token of model turn k (a model turn is a maximal
run of sampled tokens), so a row's score sum is ``reward + sum(turn_rewards)``.

Guarantees: a trajectory longer than ``max_prompt_len``/``max_response_len`` is an error naming
it, unless ``truncate=True`` (prompts keep their last tokens, responses their first); token
fields round-trip through :func:`batch_to_trajectories`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from agentrl.batch.schema import BatchError, check_batch
from agentrl.types import Trajectory

__all__ = ["batch_to_trajectories", "non_tensor_list", "trajectories_to_batch"]


def _model_turn_ends(loss_mask: Sequence[int]) -> list[int]:
    """Positions of the last token of each maximal run of 1s in ``loss_mask``."""
    ends = []
    for t, m in enumerate(loss_mask):
        if m and (t + 1 == len(loss_mask) or not loss_mask[t + 1]):
            ends.append(t)
    return ends


def _name(traj: Trajectory, row: int) -> str:
    return f"trajectory {row} (uid={traj.uid!r}, index={traj.index}, task_id={traj.task_id!r})"


def trajectories_to_batch(
    trajs: Sequence[Trajectory],
    pad_token_id: int,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    truncate: bool = False,
) -> TensorDict:
    """Pad trajectories into the trainer's batch (layout: :data:`agentrl.batch.BATCH_SCHEMA`).

    Args:
        trajs: the episodes, in row order (at least one).
        pad_token_id: id written into padding positions (never attended: attention_mask is 0).
        max_prompt_len: longest allowed prompt (None = no limit).
        max_response_len: longest allowed response (None = no limit).
        truncate: cut over-long prompts (keep the last tokens) and responses (keep the first)
            instead of raising.

    Returns:
        A TensorDict with batch size ``[B]``; ``P`` and ``R`` are the longest (possibly
        truncated) prompt and response, at least 1 each.
    """
    if not trajs:
        raise BatchError("trajectories_to_batch got no trajectories; a batch needs at least one")
    fitted = [
        _fit(traj, row, max_prompt_len, max_response_len, truncate)
        for row, traj in enumerate(trajs)
    ]
    p_max = max(1, max(len(p_ids) for p_ids, _ in fitted))
    r_max = max(1, max(r_len for _, r_len in fitted))
    cols = _padded_columns(len(trajs), p_max, r_max, pad_token_id)
    for row, (traj, (p_ids, r_len)) in enumerate(zip(trajs, fitted, strict=True)):
        _fill_row(cols, row, traj, p_ids, r_len)
    prompt_attn, resp_attn = cols.pop("prompt_attention"), cols.pop("response_attention")
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = TensorDict(
        {
            "prompts": cols["prompts"],
            "responses": cols["responses"],
            "input_ids": torch.cat([cols["prompts"], cols["responses"]], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": cols["response_mask"],
            "rollout_log_probs": cols["rollout_log_probs"],
            "policy_version": cols["policy_version"],
            "token_level_scores": cols["token_level_scores"],
        },
        batch_size=[len(trajs)],
    )
    if any(t.teacher_logprobs for t in trajs):
        batch["teacher_log_probs"] = _teacher_column(trajs, fitted, r_max)
    batch["uid"] = _string_stack([t.uid for t in trajs])
    batch["agent"] = _string_stack([t.agent for t in trajs])
    batch["data_source"] = _string_stack([t.data_source for t in trajs])
    return check_batch(batch, "trajectories_to_batch")


def _teacher_column(
    trajs: Sequence[Trajectory], fitted: list[tuple[list[int], int]], r_max: int
) -> torch.Tensor:
    """``[B, R]`` teacher logprobs (0 on padding); every row with a response must have them."""
    col = torch.zeros((len(trajs), r_max), dtype=torch.float32)
    for row, (traj, (_, r_len)) in enumerate(zip(trajs, fitted, strict=True)):
        if r_len and not traj.teacher_logprobs:
            raise BatchError(
                f"{_name(traj, row)} has no teacher_logprobs while others in the batch do; a "
                "distillation batch needs the teacher's logprobs on every row"
            )
        if r_len:
            col[row, :r_len] = torch.tensor(traj.teacher_logprobs[:r_len], dtype=torch.float32)
    return col


def _fit(
    traj: Trajectory,
    row: int,
    max_prompt_len: int | None,
    max_response_len: int | None,
    truncate: bool,
) -> tuple[list[int], int]:
    """The prompt ids and response length of ``traj`` within the limits (cut when ``truncate``:
    the prompt keeps its last tokens, the response its first); an over-long one is an error."""
    p_ids = traj.prompt_ids
    r_len = traj.response_length
    if max_prompt_len is not None and len(p_ids) > max_prompt_len:
        if not truncate:
            raise BatchError(
                f"{_name(traj, row)} has a {len(p_ids)}-token prompt, over max_prompt_len="
                f"{max_prompt_len}; raise the limit or pass truncate=True"
            )
        p_ids = p_ids[len(p_ids) - max_prompt_len :]
    if max_response_len is not None and r_len > max_response_len:
        if not truncate:
            raise BatchError(
                f"{_name(traj, row)} has a {r_len}-token response, over max_response_len="
                f"{max_response_len}; raise the limit or pass truncate=True"
            )
        r_len = max_response_len
    return p_ids, r_len


def _padded_columns(
    batch_size: int, p_max: int, r_max: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The batch's columns filled with their padding values (prompt ``[B, P]``, others
    ``[B, R]``), plus the prompt and response halves of the attention mask."""
    return {
        "prompts": torch.full((batch_size, p_max), pad_token_id, dtype=torch.long),
        "prompt_attention": torch.zeros((batch_size, p_max), dtype=torch.long),
        "responses": torch.full((batch_size, r_max), pad_token_id, dtype=torch.long),
        "response_attention": torch.zeros((batch_size, r_max), dtype=torch.long),
        "response_mask": torch.zeros((batch_size, r_max), dtype=torch.long),
        "rollout_log_probs": torch.zeros((batch_size, r_max), dtype=torch.float32),
        "policy_version": torch.full((batch_size, r_max), -1, dtype=torch.long),
        "token_level_scores": torch.zeros((batch_size, r_max), dtype=torch.float32),
    }


def _fill_row(
    cols: dict[str, torch.Tensor], row: int, traj: Trajectory, p_ids: list[int], r_len: int
) -> None:
    """Write ``traj`` (prompt ``p_ids``, first ``r_len`` response tokens) into row ``row``:
    the prompt left-padded, the response fields right-padded, the rewards on their tokens."""
    p_max = cols["prompts"].shape[1]
    if p_ids:
        cols["prompts"][row, p_max - len(p_ids) :] = torch.tensor(p_ids, dtype=torch.long)
        cols["prompt_attention"][row, p_max - len(p_ids) :] = 1
    scores = cols["token_level_scores"]
    if r_len == 0:
        # nothing to train on, but the score still counts in its group's statistics
        scores[row, 0] = float(traj.reward) + float(sum(traj.turn_rewards))
        return
    cols["responses"][row, :r_len] = torch.tensor(traj.response_ids[:r_len], dtype=torch.long)
    cols["response_attention"][row, :r_len] = 1
    mask = traj.loss_mask[:r_len]
    cols["response_mask"][row, :r_len] = torch.tensor(mask, dtype=torch.long)
    cols["rollout_log_probs"][row, :r_len] = torch.tensor(
        traj.rollout_logprobs[:r_len], dtype=torch.float32
    )
    cols["policy_version"][row, :r_len] = torch.tensor(
        traj.policy_version[:r_len], dtype=torch.long
    )
    _place_rewards(scores[row], row, traj, mask, r_len)


def _place_rewards(
    scores: torch.Tensor, row: int, traj: Trajectory, mask: list[int], r_len: int
) -> None:
    """Add the rewards of ``traj`` to its ``[R]`` score row: turn reward k on the last token of
    model turn k (turns cut away by truncation lose theirs), the episode reward on the last
    sampled token (or on the last kept token when none was sampled)."""
    ends = _model_turn_ends(mask)
    if traj.turn_rewards:
        full_ends = _model_turn_ends(traj.loss_mask)
        if len(traj.turn_rewards) != len(full_ends):
            raise BatchError(
                f"{_name(traj, row)} has {len(traj.turn_rewards)} turn_rewards but "
                f"{len(full_ends)} model turns (runs of loss_mask 1); give one reward per turn"
            )
        for pos, turn_reward in zip(ends, traj.turn_rewards, strict=False):
            scores[pos] += float(turn_reward)
    scores[ends[-1] if ends else r_len - 1] += float(traj.reward)


def _string_stack(values: list[str]) -> NonTensorStack:
    """One string per row, stored so that slicing/indexing the batch slices it too."""
    # from_list is annotated for mappings but documented for any non-tensor values
    return NonTensorStack.from_list(values)  # pyright: ignore[reportArgumentType]


def non_tensor_list(batch: TensorDict, key: str) -> list[str]:
    """The per-row strings stored under ``key`` (``uid``, ``agent``, ``data_source``)."""
    value = batch.get(key)
    if isinstance(value, NonTensorStack):
        return [str(v) for v in value.tolist()]
    data = getattr(value, "data", value)
    return [str(data)] * batch.batch_size[0]


def batch_to_trajectories(batch: TensorDict) -> list[Trajectory]:
    """Undo :func:`trajectories_to_batch` for the token fields.

    Recovers ``prompt_ids``, ``response_ids``, ``loss_mask``, ``rollout_logprobs``,
    ``policy_version``, ``uid``, ``agent``, ``data_source``; ``reward`` is the row's score sum
    (exact when the trajectory had no ``turn_rewards``). Works on trimmed micro-batches too.
    """
    prompts = batch["prompts"]
    p_len = prompts.shape[1]
    attn = batch["attention_mask"]
    responses = batch["responses"]
    uids = non_tensor_list(batch, "uid")
    agents = non_tensor_list(batch, "agent")
    sources = non_tensor_list(batch, "data_source")
    out = []
    for row in range(batch.batch_size[0]):
        p_keep = attn[row, :p_len].bool()
        r_keep = attn[row, p_len:].bool()
        out.append(
            Trajectory(
                prompt_ids=prompts[row][p_keep].tolist(),
                response_ids=responses[row][r_keep].tolist(),
                loss_mask=batch["response_mask"][row][r_keep].tolist(),
                rollout_logprobs=batch["rollout_log_probs"][row][r_keep].tolist(),
                policy_version=batch["policy_version"][row][r_keep].tolist(),
                reward=float(batch["token_level_scores"][row].sum()),
                uid=uids[row],
                agent=agents[row],
                data_source=sources[row],
            )
        )
    return out
