-- Held-out evaluation curve: success and pass@k per policy version.
--
-- Answers: is the policy getting better on tasks it never trains on? From the
-- evaluations table (one row per evaluation, written by pipeline policy eval
-- and by the demo after every iteration), joined to checkpoints for when each
-- version was published. Evaluations with the same settings are comparable:
-- the same env, split, n, seed, samples and temperature draw the same tasks.
-- When a version was evaluated more than once with the same settings (a
-- different engine, say), the newest row is kept.
--
-- Parameters:
-- @param env = NULL      one environment (NULL: every one)
-- @param samples = NULL  only evaluations with this many samples per task (NULL: all)
--
-- Columns:
--   env, split, n, seed, samples, temperature   the evaluation settings (one curve each)
--   policy_version, checkpoint_id, published_at (checkpoint created_at)
--   success       share of judged samples that pass (= pass@1)
--   pass_at_k     k -> pass@k (map)
--   pass_at_max   pass@k at the largest k evaluated
--   reward_mean, format_rate, tool_use_rate, judged, engine, evaluated_at
WITH e AS (
    SELECT *,
        row_number() OVER (PARTITION BY env, split, n, seed, samples, temperature, policy_version
                           ORDER BY evaluated_at DESC) AS rn
    FROM evaluations
    WHERE ($env::VARCHAR IS NULL OR env = $env::VARCHAR)
      AND ($samples::BIGINT IS NULL OR samples = $samples::BIGINT)
)
SELECT
    e.env, e.split, e.n, e.seed, e.samples, e.temperature,
    e.policy_version, e.checkpoint_id, c.created_at AS published_at,
    e.success,
    e.pass_at_k,
    e.pass_at_k[e.samples] AS pass_at_max,
    e.reward_mean, e.format_rate, e.tool_use_rate, e.judged, e.engine,
    e.evaluated_at
FROM e
LEFT JOIN checkpoints AS c USING (checkpoint_id)
WHERE e.rn = 1
ORDER BY e.env, e.split, e.n, e.seed, e.samples, e.temperature, e.policy_version
