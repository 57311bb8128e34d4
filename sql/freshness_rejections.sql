-- Rejection rate by difficulty and length bucket, with the share of members excluded as stale.
--
-- Answers: does a freshness gate quietly turn training into an easy, short-task
-- set? From receipts (one row per group decision): a group is rejected when
-- its decision is not 'admit'; a member is excluded as stale when its reason
-- in excluded_members starts with 'stale' (stale_policy, stale_wait).
-- Bucket labels are the receipt's (null when admission did not label it).
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, difficulty, length_bucket
--   groups, admitted_groups, rejected_groups
--   rejection_rate           rejected_groups / groups
--   arrived_members          sum of arrived_members
--   excluded_members         members with an exclusion reason
--   stale_excluded_members   of those, reasons starting with 'stale'
--   stale_exclusion_rate     stale_excluded_members / arrived_members
WITH r AS (
    SELECT run_id, difficulty, length_bucket, decision, arrived_members,
           map_values(excluded_members) AS reasons
    FROM receipts
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
)
SELECT
    run_id, difficulty, length_bucket,
    count(*) AS groups,
    count(*) FILTER (WHERE decision = 'admit') AS admitted_groups,
    count(*) FILTER (WHERE decision <> 'admit') AS rejected_groups,
    count(*) FILTER (WHERE decision <> 'admit') / count(*) AS rejection_rate,
    sum(arrived_members)::BIGINT AS arrived_members,
    sum(len(reasons))::BIGINT AS excluded_members,
    sum(len(list_filter(reasons, lambda x: starts_with(x, 'stale'))))::BIGINT AS stale_excluded_members,
    sum(len(list_filter(reasons, lambda x: starts_with(x, 'stale')))) / nullif(sum(arrived_members), 0)
        AS stale_exclusion_rate
FROM r
GROUP BY run_id, difficulty, length_bucket
ORDER BY run_id, difficulty NULLS LAST, length_bucket NULLS LAST
