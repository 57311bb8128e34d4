-- Checkpoints a trajectory influenced: trained on it directly, or descended from one that did.
--
-- Answers: if this trajectory turns out to be bad (a verifier bug, leaked
-- data), which checkpoints are affected? depth 0 = a checkpoint whose
-- snapshots hold the trajectory; depth d = a descendant d parent links below
-- such a checkpoint (parent_checkpoint_id), which inherited what it learned.
--
-- Parameters:
-- @param trajectory_id          the trajectory (required)
--
-- Columns:
--   checkpoint_id, policy_version, created_at
--   depth          shortest distance in parent links from a checkpoint trained on it
--   relation       direct (depth 0) / inherited
--   via_snapshots  the trajectory's snapshots behind this influence (sorted)
WITH RECURSIVE
ck AS (
    SELECT checkpoint_id, unnest(snapshot_ids) AS snapshot_id FROM checkpoints
),
direct AS (
    SELECT DISTINCT ck.checkpoint_id, m.snapshot_id
    FROM snapshot_members AS m JOIN ck USING (snapshot_id)
    WHERE m.trajectory_id = $trajectory_id::VARCHAR
),
influenced(checkpoint_id, snapshot_id, depth) AS (
    SELECT checkpoint_id, snapshot_id, 0 FROM direct
    UNION
    SELECT c.checkpoint_id, i.snapshot_id, i.depth + 1
    FROM influenced AS i
    JOIN checkpoints AS c ON c.parent_checkpoint_id = i.checkpoint_id
    WHERE i.depth < 10000
)
SELECT
    i.checkpoint_id,
    c.policy_version,
    c.created_at,
    min(i.depth) AS depth,
    CASE WHEN min(i.depth) = 0 THEN 'direct' ELSE 'inherited' END AS relation,
    list_sort(list_distinct(list(i.snapshot_id))) AS via_snapshots
FROM influenced AS i
JOIN checkpoints AS c USING (checkpoint_id)
GROUP BY i.checkpoint_id, c.policy_version, c.created_at
ORDER BY c.policy_version, c.created_at, i.checkpoint_id
