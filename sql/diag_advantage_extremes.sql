-- Diagnostics: the top- and bottom-advantage members of a snapshot, for inspection.
--
-- Answers: what is the update pushing hardest towards and away from? Read the
-- highest-advantage members (is their reward earned, or is a heuristic
-- component farmed?) and the lowest (are they infrastructure-shaped failures
-- that slipped through?). From snapshot_members joined to the members'
-- trajectory scalars; ties broken by trajectory_id. A member of a small
-- snapshot can be in both lists.
--
-- Parameters:
-- @param snapshot_id = NULL   the snapshot (NULL: the newest by created_at, then snapshot_id)
-- @param k = 5                members per side
--
-- Columns:
--   side              top | bottom
--   rank              1 = the most extreme on its side
--   snapshot_id, trajectory_id, group_id
--   advantage, reward
--   run_id, task_id, verdict, stop_reason, response_len, num_tool_calls
WITH snap AS (
    SELECT coalesce($snapshot_id::VARCHAR,
                    (SELECT snapshot_id FROM snapshots ORDER BY created_at DESC, snapshot_id LIMIT 1)) AS snapshot_id
),
m AS (
    SELECT sm.snapshot_id, sm.trajectory_id, sm.group_id, sm.advantage, sm.reward,
           row_number() OVER (ORDER BY sm.advantage DESC, sm.trajectory_id) AS top_rank,
           row_number() OVER (ORDER BY sm.advantage ASC, sm.trajectory_id) AS bottom_rank
    FROM snapshot_members AS sm
    WHERE sm.snapshot_id = (SELECT snapshot_id FROM snap)
),
picked AS (
    SELECT 'top' AS side, top_rank AS rank, * EXCLUDE (top_rank, bottom_rank) FROM m WHERE top_rank <= $k
    UNION ALL
    SELECT 'bottom', bottom_rank, * EXCLUDE (top_rank, bottom_rank) FROM m WHERE bottom_rank <= $k
)
SELECT p.side, p.rank, p.snapshot_id, p.trajectory_id, p.group_id, p.advantage, p.reward,
       t.run_id, t.task_id, t.verdict, t.stop_reason, t.response_len, t.num_tool_calls
FROM picked AS p
LEFT JOIN (SELECT trajectory_id, run_id, task_id, verdict, stop_reason, response_len, num_tool_calls
           FROM trajectories) AS t USING (trajectory_id)
ORDER BY p.side DESC, p.rank
