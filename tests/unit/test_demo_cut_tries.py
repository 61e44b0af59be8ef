"""The demo crashes after a checkpoint that caught a call mid-generation, and takes another one
(resuming the mesh) when a checkpoint caught none while rollouts are still to start."""

from __future__ import annotations

import pytest

from nemo_gym_ckpt.collect.published import CollectionManifest
from nemo_gym_ckpt.demo.run import CUT_TRIES, again_for_a_cut

TASKS = 24


def _manifest(*, staging: list[str], rows_done: int, in_flight: int) -> CollectionManifest:
    return CollectionManifest(
        checkpoint_id="ckpt-1", run_id="run-1", created_at="2026-12-06T10:00:00Z",
        continued=[f"r{n}:0" for n in range(in_flight)], restarted=[], rows_done=rows_done,
        config_digest="c" * 64, input_digest="i" * 64, num_repeats=1,
        manifests={"policy_model": "gym/model/policy_model/manifest.json"},
        staging_keys={"policy_model": staging})


@pytest.mark.parametrize(("staging", "rows_done", "in_flight", "uncut_before", "again"), [
    ([], 6, 8, 0, True),  # no cut, ten rollouts still to start: resume and try again
    ([], 6, 8, CUT_TRIES - 2, True),  # the last try is still to come
    (["stage-1"], 6, 8, 0, False),  # a cut was kept: crash now
    ([], 6, 8, CUT_TRIES - 1, False),  # tries used up: crash with what there is
    ([], 16, 8, 0, False),  # every rollout has started: the run may end before another checkpoint
])
def test_the_demo_tries_again_only_for_a_missing_cut_while_rollouts_are_to_start(
    staging: list[str], rows_done: int, in_flight: int, uncut_before: int, again: bool
) -> None:
    manifest = _manifest(staging=staging, rows_done=rows_done, in_flight=in_flight)
    assert again_for_a_cut(manifest, uncut_before, TASKS) is again
