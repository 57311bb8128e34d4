-- Comparability per group: how many distinct versions each group mixes, its valid members and outcome.
--
-- Answers: which groups break "one group = one policy version, one environment
-- snapshot, one verifier", and what each group's outcome is. Same definitions
-- as comparability.sql (valid member, zero variance).
--
-- Parameters:
-- @param run_id = NULL             only this experiment (NULL: every run)
-- @param inconsistent_only = 0     1: only groups that mix versions
--
-- Columns:
--   run_id, group_id, task_id, group_size
--   members                arrived members
--   valid_members          members with a valid evaluation
--   passes                 valid members with verdict PASS
--   policy_versions, env_versions, verifier_versions, tokenizer_revs,
--   prompt_template_revs, temperatures   distinct values in the group
--   consistent             true when every version field has one value
--   zero_variance          valid rewards all equal (null below 2 valid members)
--   outcome                mixed / all_correct / all_wrong / too_few (< 2 valid members)
WITH g AS (
    SELECT
        run_id,
        group_id,
        min(task_id) AS task_id,
        max(group_size) AS group_size,
        count(*) AS members,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS valid_members,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict = 'PASS' AND reward IS NOT NULL) AS passes,
        count(DISTINCT policy_version) AS policy_versions,
        count(DISTINCT env_version) AS env_versions,
        count(DISTINCT verifier_version) AS verifier_versions,
        count(DISTINCT tokenizer_rev) AS tokenizer_revs,
        count(DISTINCT prompt_template_rev) AS prompt_template_revs,
        count(DISTINCT temperature) AS temperatures,
        max(reward) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                              AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS r_max,
        min(reward) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                              AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS r_min
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
    GROUP BY run_id, group_id
)
SELECT
    run_id, group_id, task_id, group_size, members, valid_members, passes,
    policy_versions, env_versions, verifier_versions, tokenizer_revs, prompt_template_revs, temperatures,
    (policy_versions = 1 AND env_versions = 1 AND verifier_versions = 1 AND tokenizer_revs = 1
     AND prompt_template_revs = 1 AND temperatures = 1) AS consistent,
    CASE WHEN valid_members >= 2 THEN r_max = r_min END AS zero_variance,
    CASE WHEN valid_members < 2 THEN 'too_few'
         WHEN passes = valid_members THEN 'all_correct'
         WHEN passes = 0 THEN 'all_wrong'
         ELSE 'mixed' END AS outcome
FROM g
WHERE $inconsistent_only::INTEGER = 0
   OR NOT (policy_versions = 1 AND env_versions = 1 AND verifier_versions = 1 AND tokenizer_revs = 1
           AND prompt_template_revs = 1 AND temperatures = 1)
ORDER BY run_id, group_id
