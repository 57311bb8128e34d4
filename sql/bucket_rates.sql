-- Admission and rejection rates per bucket (difficulty, response length, tool calls, reward std), from receipts.
--
-- Answers: does a gate quietly turn training into an easy-task set? A freshness
-- gate that drops every long, hard task shows up here as a low admit_rate in
-- the long/hard buckets. One row per (bucket, label); every decision column
-- counts groups. Labels come from the receipts (pipeline/admission/decide.py).
-- @param run_id = NULL       only this experiment (NULL: every run)
-- @param admission_run_id = NULL   only this admission run (NULL: all)
WITH r AS (
    SELECT * FROM receipts
    WHERE ($run_id IS NULL OR run_id = $run_id)
      AND ($admission_run_id IS NULL OR admission_run_id = $admission_run_id)
),
labelled AS (
    SELECT 'difficulty' AS bucket, coalesce(difficulty, '(none)') AS label, decision, r.* EXCLUDE (difficulty, decision) FROM r
    UNION ALL
    SELECT 'length', coalesce(length_bucket, '(none)'), decision, r.* EXCLUDE (difficulty, decision) FROM r
    UNION ALL
    SELECT 'tool_calls', coalesce(tool_call_bucket, '(none)'), decision, r.* EXCLUDE (difficulty, decision) FROM r
    UNION ALL
    SELECT 'reward_std', coalesce(reward_std_bucket, '(none)'), decision, r.* EXCLUDE (difficulty, decision) FROM r
)
SELECT bucket, label,
       count(*) AS groups,
       count(*) FILTER (WHERE decision = 'admit') AS admitted,
       count(*) FILTER (WHERE decision <> 'admit') AS rejected,
       round(count(*) FILTER (WHERE decision = 'admit') / count(*), 4) AS admit_rate,
       count(*) FILTER (WHERE decision = 'zero_variance') AS zero_variance,
       count(*) FILTER (WHERE decision = 'insufficient_valid') AS insufficient_valid,
       count(*) FILTER (WHERE decision = 'gated') AS gated,
       count(*) FILTER (WHERE decision = 'capped') AS capped,
       count(*) FILTER (WHERE decision = 'incomplete') AS incomplete,
       sum(cardinality(excluded_members)) AS excluded_members,
       sum(arrived_members) AS arrived_members
FROM labelled
GROUP BY bucket, label
ORDER BY bucket, label
