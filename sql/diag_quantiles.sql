-- Diagnostics: quantiles of rewards, advantages and KL, to see tails that means hide.
--
-- Answers: is the reward distribution bimodal or drifting in its tails, are
-- advantages exploding for a few members, does the KL have spikes? reward:
-- valid trajectories (as in quality.sql); advantage: every admitted member
-- in snapshot_members (the run's groups via receipts when run_id is given);
-- kl, approx_kl: one value per optimizer step in metrics, every training run
-- (kl is null without a KL reference and then left out). Quantiles are
-- quantile_cont (linear interpolation, numpy's default).
--
-- Parameters:
-- @param run_id = NULL      reward and advantage of this experiment only (NULL: every run)
--
-- Columns:
--   metric     reward | advantage | kl | approx_kl
--   n          values
--   mean
--   min, p01, p05, p25, p50, p75, p95, p99, max
WITH x AS (
    SELECT 'reward' AS metric, reward AS value
    FROM trajectories
    WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
      AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
    UNION ALL
    SELECT 'advantage', m.advantage
    FROM snapshot_members AS m
    WHERE $run_id::VARCHAR IS NULL
       OR m.group_id IN (SELECT group_id FROM receipts WHERE run_id = $run_id::VARCHAR)
    UNION ALL
    SELECT 'kl', kl FROM metrics WHERE kl IS NOT NULL
    UNION ALL
    SELECT 'approx_kl', approx_kl FROM metrics WHERE approx_kl IS NOT NULL
)
SELECT
    metric,
    count(value) AS n,
    avg(value) AS mean,
    min(value) AS min,
    quantile_cont(value, 0.01) AS p01,
    quantile_cont(value, 0.05) AS p05,
    quantile_cont(value, 0.25) AS p25,
    quantile_cont(value, 0.50) AS p50,
    quantile_cont(value, 0.75) AS p75,
    quantile_cont(value, 0.95) AS p95,
    quantile_cont(value, 0.99) AS p99,
    max(value) AS max
FROM x
GROUP BY metric
ORDER BY metric
