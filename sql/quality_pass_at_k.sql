-- pass@k per policy version with the unbiased estimator 1 - C(n-c, k)/C(n, k), averaged over groups.
--
-- Answers: the chance that at least one of k samples solves a problem, from
-- groups of n >= k samples with c correct (Chen et al. 2021). A group is one
-- problem; n = its valid members (as in quality.sql), c = those with verdict
-- PASS; groups with n < k are left out. Computed in the stable product form
-- C(n-c, k)/C(n, k) = prod_{i=n-c+1..n} (1 - k/i), exactly as
-- pipeline.query.metrics.pass_at_k (tests check they agree).
-- A group belongs to the policy version of its oldest member.
--
-- Parameters:
-- @param run_id = NULL    only this experiment (NULL: every run)
-- @param k = 1            samples per attempt
--
-- Columns:
--   run_id, policy_version, k
--   groups        groups with at least k valid members
--   pass_at_k     mean pass@k over those groups
WITH g AS (
    SELECT
        run_id,
        group_id,
        min(policy_version) AS policy_version,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS n,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict = 'PASS' AND reward IS NOT NULL) AS c
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
    GROUP BY run_id, group_id
),
s AS (
    SELECT
        run_id, policy_version,
        CASE WHEN n - c < $k::INTEGER THEN 1.0
             WHEN c = 0 THEN 0.0
             ELSE 1.0 - list_aggregate(
                 list_transform(range(n - c + 1, n + 1), lambda i: 1.0 - $k::INTEGER / i), 'product')
        END AS pass_at_k
    FROM g
    WHERE n >= $k::INTEGER
)
SELECT run_id, policy_version, $k::INTEGER AS k, count(*) AS groups, avg(pass_at_k) AS pass_at_k
FROM s
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
