-- Lineage summary per checkpoint: how many snapshots, groups, trajectories and tasks trained it, and from which versions.
--
-- Answers: what did each checkpoint learn from, in one row? Direct lineage
-- only (the snapshots in its snapshot_ids), as in lineage.sql.
--
-- Parameters:
-- @param checkpoint_id = NULL   one checkpoint (NULL: every checkpoint)
--
-- Columns:
--   checkpoint_id, parent_checkpoint_id, policy_version, created_at, global_step
--   snapshots, groups, trajectories, tasks        distinct counts
--   policy_versions, env_versions, verifier_versions   sorted distinct versions of the trajectories
--   reward_mean                                   mean member reward (snapshot_members)
WITH c AS (
    SELECT checkpoint_id, parent_checkpoint_id, policy_version, created_at, global_step, snapshot_ids
    FROM checkpoints
    WHERE $checkpoint_id::VARCHAR IS NULL OR checkpoint_id = $checkpoint_id::VARCHAR
),
s AS (
    SELECT checkpoint_id, unnest(snapshot_ids) AS snapshot_id FROM c
),
m AS (
    SELECT s.checkpoint_id, s.snapshot_id, m.trajectory_id, m.group_id, m.reward,
           t.task_id, t.policy_version, t.env_version, t.verifier_version
    FROM s
    JOIN snapshot_members AS m USING (snapshot_id)
    LEFT JOIN trajectories AS t USING (trajectory_id)
),
agg AS (
    SELECT
        checkpoint_id,
        count(DISTINCT snapshot_id) AS snapshots,
        count(DISTINCT group_id) AS groups,
        count(DISTINCT trajectory_id) AS trajectories,
        count(DISTINCT task_id) AS tasks,
        list_sort(list_distinct(list(policy_version))) AS policy_versions,
        list_sort(list_distinct(list(env_version))) AS env_versions,
        list_sort(list_distinct(list(verifier_version))) AS verifier_versions,
        avg(reward) AS reward_mean
    FROM m
    GROUP BY checkpoint_id
)
SELECT
    c.checkpoint_id, c.parent_checkpoint_id, c.policy_version, c.created_at, c.global_step,
    coalesce(a.snapshots, 0) AS snapshots,
    coalesce(a.groups, 0) AS groups,
    coalesce(a.trajectories, 0) AS trajectories,
    coalesce(a.tasks, 0) AS tasks,
    a.policy_versions, a.env_versions, a.verifier_versions, a.reward_mean
FROM c
LEFT JOIN agg AS a USING (checkpoint_id)
ORDER BY c.policy_version, c.created_at, c.checkpoint_id
