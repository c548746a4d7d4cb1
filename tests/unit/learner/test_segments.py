"""A trajectory holding several segments (``sequence_starts``: an external agent's session whose
history changed) is checked by the contract and trained by the learner as one row per segment:
its advantage computed once per trajectory, the loss denominators counting it as ONE sequence.

Every expected value below is worked out by hand in the comments, not by the code under test.

Layout of trajectory "a" (reward 1), two segments::

    tokens     1  2  3  4 | 1  2  3  4  9  5
    mask       0  0  1  1 | 0  0  0  0  0  1
    versions  -1 -1  3  3 |-1 -1 -1 -1 -1  4
    starts     0          | 4

and "b" (reward 0, same group), one sequence: prompt 1 2, sampled 7 8 6 5 (version 4).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trajmesh.contract import Trajectory  # noqa: E402
from trajmesh.learner import advantages, step  # noqa: E402
from trajmesh.learner.microbatch import global_counts  # noqa: E402
from trajmesh.learner.objective import ObjectiveConfig, decoupled_ppo_loss  # noqa: E402
from trajmesh.v1 import trajectory_pb2 as pb  # noqa: E402

TASK = pb.Task(task_id="t", group_id="g")


def _two_segments(tid: str = "a", reward: float = 1.0) -> Trajectory:
    t = Trajectory.new(TASK, trajectory_id=tid)
    t.start_segment()
    t.append_prompt([1, 2])
    t.append_sampled([3, 4], [-0.5, -1.0], 3)
    t.start_segment()
    t.append_prompt([1, 2, 3, 4, 9], turn_index=1)
    t.append_sampled([5], [-0.25], 4, turn_index=1)
    t.finish(pb.EOS)
    t.set_reward(reward)
    return t


def _one_sequence(tid: str = "b", reward: float = 0.0) -> Trajectory:
    t = Trajectory.new(TASK, trajectory_id=tid)
    t.append_prompt([1, 2])
    t.append_sampled([7, 8, 6, 5], [-0.1, -0.2, -0.3, -0.4], 4)
    t.finish(pb.EOS)
    t.set_reward(reward)
    return t


# ---------------------------------------------------------------- the contract


def test_segments_are_recorded_and_valid() -> None:
    t = _two_segments()
    assert list(t.pb.sequence_starts) == [0, 4]
    assert t.segment_bounds() == [(0, 4), (4, 10)]
    assert t.validate() == []
    assert _one_sequence().segment_bounds() == [(0, 6)]  # no starts: one sequence


@pytest.mark.parametrize("starts, why", [
    ([4], "not 0"),                  # the first sequence must start at 0
    ([0, 4, 4], "strictly"),         # a repeated start
    ([0, 7, 4], "strictly"),         # out of order
    ([0, 10], "past"),               # at the token count (10 tokens)
    ([0, 2], "mask-1"),              # token 2 is sampled: a segment without its prompt
])
def test_bad_sequence_starts_are_violations(starts: list[int], why: str) -> None:
    t = _two_segments()
    t.pb.ClearField("sequence_starts")
    t.pb.sequence_starts.extend(starts)
    (v,) = t.validate()
    assert v.name == "sequence_starts_invalid" and why in v.detail


# ---------------------------------------------------------------- build_batch: one row per segment


def test_build_batch_splits_a_trajectory_into_segment_rows() -> None:
    batch = step.build_batch([_two_segments(), _one_sequence()], pad_id=0)
    assert batch.lengths() == [4, 6, 6]
    assert batch.input_ids_BT.tolist() == [[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 9, 5], [1, 2, 7, 8, 6, 5]]
    assert batch.mask_BT.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1]]
    assert batch.versions_BT.tolist() == [[-1, -1, 3, 3, -1, -1], [-1, -1, -1, -1, -1, 4], [-1, -1, 4, 4, 4, 4]]
    assert batch.behavior_logp_BT[0].tolist() == [0.0, 0.0, -0.5, -1.0, 0.0, 0.0]
    assert batch.behavior_logp_BT[1].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -0.25]
    text, prompt, unset = pb.TEXT, pb.PROMPT, pb.ACTION_TYPE_UNSPECIFIED
    assert batch.action_type_BT[:2].tolist() == [[prompt, prompt, text, text, unset, unset],
                                                 [prompt] * 5 + [text]]
    assert batch.trajectory_ids == ["a", "a", "b"] and batch.unique_trajectory_ids() == ["a", "b"]
    assert batch.reward_B.tolist() == [1.0, 1.0, 0.0]
    # a's rows hold 2 and 1 of its 3 trained tokens
    assert batch.row_share_B.tolist() == pytest.approx([2 / 3, 1 / 3, 1.0])
    assert batch.trajectory_rewards().tolist() == [1.0, 0.0]
    # every trained token once: 3 of a + 4 of b
    assert int(batch.mask_BT.sum()) == 7
    sub = batch.select([2, 1])
    assert sub.trajectory_ids == ["b", "a"] and sub.row_share_B.tolist() == pytest.approx([1.0, 1 / 3])


def test_advantages_are_per_trajectory_and_copied_to_its_rows() -> None:
    batch = step.build_batch([_two_segments(), _one_sequence()], pad_id=0)
    # GRPO over the 2 trajectories: rewards 1, 0 → mean 0.5, unbiased std sqrt(0.5) → ±0.5/0.70711.
    # (Counting rows, the group would be 1, 1, 0 and a's advantage 0.57735.)
    grpo = advantages.advantages_B(batch, "grpo", scale_by_std=True, eps=1e-6)
    assert grpo.tolist() == pytest.approx([0.707106, 0.707106, -0.707106], abs=1e-5)
    # RLOO over 2: R_i − the other's reward = ±1
    assert advantages.advantages_B(batch, "rloo", scale_by_std=True, eps=1e-6).tolist() == pytest.approx([1, 1, -1])
    # REINFORCE++: ±0.5 per trajectory on its tokens (3 of +0.5, 4 of −0.5): mean −1/14,
    # population variance = (3·(4/7)² + 4·(3/7)²)/7 = 12/49 → std 0.49487; (a − μ)/std
    rpp = advantages.advantages_BT(batch, "reinforce_pp", scale_by_std=True, eps=1e-6)
    up, down = (0.5 + 1 / 14) / 0.494872, (-0.5 + 1 / 14) / 0.494872
    expected = [0, 0, up, up, 0, 0] + [0, 0, 0, 0, 0, up] + [0, 0, down, down, down, down]
    assert rpp.flatten().tolist() == pytest.approx(expected, abs=1e-5)


def test_a_single_sequence_batch_is_as_before() -> None:
    batch = step.build_batch([_one_sequence("b1", 1.0), _one_sequence("b2", 0.0)], pad_id=0)
    assert batch.row_share_B.tolist() == [1.0, 1.0] and batch.trajectory_index_B.tolist() == [0, 1]
    assert global_counts(batch.mask_BT, row_share_B=batch.row_share_B).sequences == 2.0


# ---------------------------------------------------------------- denominators


def _loss(batch: step.Batch, adv_BT: torch.Tensor, rows: list[int], cfg: ObjectiveConfig,
          tokens: float, sequences: float) -> float:
    """The decoupled loss of `rows` at r = w = 1 (π_θ = π_prox = π_beh): L_t = −Â_t."""
    mb = batch.select(rows)
    width = mb.mask_BT.shape[1]
    adv = adv_BT.index_select(0, torch.tensor(rows))[:, :width]
    lp = mb.behavior_logp_BT
    loss, _ = decoupled_ppo_loss(lp, lp, lp, adv, mb.mask_BT, cfg, global_token_count=tokens,
                                 global_sequence_count=sequences, sequence_weight_B=mb.row_share_B)
    return float(loss)


# Advantages by hand: a's tokens 1, 2 (row 0) and 4 (row 1); b's four tokens 3 each.
ADV_BT = [[0, 0, 1, 2, 0, 0], [0, 0, 0, 0, 0, 4], [0, 0, 3, 3, 3, 3]]


@pytest.mark.parametrize("denominator, expected", [
    # token-global: −(1+2+4+12)/7 tokens
    ("token_global", -19 / 7),
    # sequence mean over TRAJECTORIES: a's token mean −7/3, b's −3 → (−7/3 − 3)/2 = −8/3
    # (rows as sequences would give (−1.5 − 4 − 3)/3 = −2.8333)
    ("sequence_mean", -8 / 3),
    # constant C = 10 over S = 2 trajectories: −19/20
    ("constant", -19 / 20),
])
def test_denominators_count_a_segmented_trajectory_once(denominator: str, expected: float) -> None:
    batch = step.build_batch([_two_segments(), _one_sequence()], pad_id=0)
    adv_BT = torch.tensor(ADV_BT, dtype=torch.float32)
    cfg = ObjectiveConfig(denominator=denominator, constant_denominator=10.0)
    counts = global_counts(batch.mask_BT, row_share_B=batch.row_share_B)
    assert (counts.tokens, counts.sequences) == (7.0, pytest.approx(2.0))
    whole = _loss(batch, adv_BT, [0, 1, 2], cfg, counts.tokens, counts.sequences)
    assert whole == pytest.approx(expected, abs=1e-5)
    # a's rows in different micro-batches: the parts, scaled by the global counts, add up the same
    split = sum(_loss(batch, adv_BT, rows, cfg, counts.tokens, counts.sequences) for rows in ([0], [1, 2]))
    assert split == pytest.approx(expected, abs=1e-5)
    # without counts given, one call over the batch counts sequences by the shares too
    lp = batch.behavior_logp_BT
    alone, _ = decoupled_ppo_loss(lp, lp, lp, adv_BT, batch.mask_BT, cfg, sequence_weight_B=batch.row_share_B)
    assert float(alone) == pytest.approx(expected, abs=1e-5)


def test_staleness_is_by_the_trajectorys_oldest_token() -> None:
    # a's oldest sampled token is v3 (segment 0): at learner version 5 its lag is 2 > eta 1
    keep, stale = step.split_stale([_two_segments(), _one_sequence()], version=5, eta=1)
    assert [t.trajectory_id for t in keep] == ["b"] and [t.trajectory_id for t in stale] == ["a"]
