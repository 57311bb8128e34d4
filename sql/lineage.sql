-- Lineage of a checkpoint: every trajectory it trained on, with its group, task and versions.
--
-- Answers: which trajectories, groups, tasks and versions trained a given
-- checkpoint (directly: the snapshots listed in its snapshot_ids; what its
-- ancestors learned from is in their own lineage). One row per (snapshot,
-- member). Trajectory columns are null when the trajectory row is gone from
-- the lake (the snapshot's own files still hold its payload).
--
-- Parameters:
-- @param checkpoint_id = NULL   the checkpoint (NULL: the newest, by policy_version then created_at)
--
-- Columns:
--   checkpoint_id, checkpoint_policy_version, snapshot_id
--   trajectory_id, group_id, task_id, task_version, run_id
--   policy_version, tokenizer_rev, prompt_template_rev, harness_version,
--   env_version, verifier_version                 versions the trajectory was generated with
--   reward, advantage, policy_lag                 as stored in snapshot_members
WITH target AS (
    SELECT checkpoint_id, policy_version, snapshot_ids FROM checkpoints
    WHERE checkpoint_id = coalesce(
        $checkpoint_id::VARCHAR,
        (SELECT checkpoint_id FROM checkpoints ORDER BY policy_version DESC, created_at DESC, checkpoint_id LIMIT 1))
),
snaps AS (
    SELECT checkpoint_id, policy_version, unnest(snapshot_ids) AS snapshot_id FROM target
)
SELECT
    s.checkpoint_id,
    s.policy_version AS checkpoint_policy_version,
    s.snapshot_id,
    m.trajectory_id,
    m.group_id,
    t.task_id,
    t.task_version,
    t.run_id,
    t.policy_version,
    t.tokenizer_rev,
    t.prompt_template_rev,
    t.harness_version,
    t.env_version,
    t.verifier_version,
    m.reward,
    m.advantage,
    m.policy_lag
FROM snaps AS s
JOIN snapshot_members AS m USING (snapshot_id)
LEFT JOIN trajectories AS t USING (trajectory_id)
ORDER BY s.snapshot_id, m.group_id, m.trajectory_id
