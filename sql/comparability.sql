-- Comparability per policy version: one configuration per group, zero-variance share, mixed / all-correct / all-wrong group rates.
--
-- Answers: do the GRPO groups of each policy version compare like with like
-- (one policy version, tokenizer, prompt template, environment snapshot,
-- verifier and temperature inside a group), and how many groups can carry a
-- learning signal at all?
--
-- Definitions:
--   A group belongs to the policy version of its oldest member (min policy_version).
--   Valid member: status not INFRA_FAILED/EXPIRED, verdict PASS or FAIL, reward
--   not null (infrastructure failures never count as policy failures).
--   Scored group: at least 2 valid members. Group rates are over scored groups.
--   Zero variance: max(reward) = min(reward) over the valid members (exact,
--   never a std threshold).
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version
--   groups                 groups of this version
--   consistent_groups      groups with one value of every version field
--   consistency_rate       consistent_groups / groups
--   policy_mixed_groups    groups spanning more than one policy_version
--   env_mixed_groups       groups spanning more than one env_version
--   verifier_mixed_groups  groups spanning more than one verifier_version
--   other_mixed_groups     groups whose tokenizer_rev, prompt_template_rev or temperature differ
--   scored_groups          groups with >= 2 valid members
--   zero_variance_share    scored groups with equal valid rewards / scored_groups
--   mixed_rate             scored groups with some but not all valid members PASS / scored_groups
--   all_correct_rate       scored groups with every valid member PASS / scored_groups
--   all_wrong_rate         scored groups with no valid member PASS / scored_groups
--   success_rate           PASS share over the valid members of scored groups (p)
--   expected_mixed_rate    mixed rate if members succeeded independently with p:
--                          mean over scored groups of 1 - p^n - (1-p)^n, n = its valid members
WITH t AS (
    SELECT * FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
g AS (
    SELECT
        run_id,
        group_id,
        min(policy_version) AS policy_version,
        count(DISTINCT policy_version) AS n_policy,
        count(DISTINCT env_version) AS n_env,
        count(DISTINCT verifier_version) AS n_verifier,
        count(DISTINCT tokenizer_rev) + count(DISTINCT prompt_template_rev)
            + count(DISTINCT temperature) AS n_other,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS n_valid,
        count(*) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                           AND verdict = 'PASS' AND reward IS NOT NULL) AS n_pass,
        max(reward) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                              AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS r_max,
        min(reward) FILTER (WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED')
                              AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL) AS r_min
    FROM t
    GROUP BY run_id, group_id
),
v AS (
    SELECT
        run_id,
        policy_version,
        count(*) AS groups,
        count(*) FILTER (WHERE n_policy = 1 AND n_env = 1 AND n_verifier = 1 AND n_other = 3) AS consistent_groups,
        count(*) FILTER (WHERE n_policy > 1) AS policy_mixed_groups,
        count(*) FILTER (WHERE n_env > 1) AS env_mixed_groups,
        count(*) FILTER (WHERE n_verifier > 1) AS verifier_mixed_groups,
        count(*) FILTER (WHERE n_other > 3) AS other_mixed_groups,
        count(*) FILTER (WHERE n_valid >= 2) AS scored_groups,
        count(*) FILTER (WHERE n_valid >= 2 AND r_max = r_min) AS zero_variance_groups,
        count(*) FILTER (WHERE n_valid >= 2 AND n_pass > 0 AND n_pass < n_valid) AS mixed_groups,
        count(*) FILTER (WHERE n_valid >= 2 AND n_pass = n_valid) AS all_correct_groups,
        count(*) FILTER (WHERE n_valid >= 2 AND n_pass = 0) AS all_wrong_groups,
        sum(n_pass) FILTER (WHERE n_valid >= 2) / sum(n_valid) FILTER (WHERE n_valid >= 2) AS success_rate
    FROM g
    GROUP BY run_id, policy_version
)
SELECT
    v.run_id,
    v.policy_version,
    v.groups,
    v.consistent_groups,
    v.consistent_groups / v.groups AS consistency_rate,
    v.policy_mixed_groups,
    v.env_mixed_groups,
    v.verifier_mixed_groups,
    v.other_mixed_groups,
    v.scored_groups,
    v.zero_variance_groups / nullif(v.scored_groups, 0) AS zero_variance_share,
    v.mixed_groups / nullif(v.scored_groups, 0) AS mixed_rate,
    v.all_correct_groups / nullif(v.scored_groups, 0) AS all_correct_rate,
    v.all_wrong_groups / nullif(v.scored_groups, 0) AS all_wrong_rate,
    v.success_rate,
    (SELECT avg(1 - pow(v.success_rate, g.n_valid) - pow(1 - v.success_rate, g.n_valid))
       FROM g
      WHERE g.run_id = v.run_id AND g.policy_version = v.policy_version AND g.n_valid >= 2
    ) AS expected_mixed_rate
FROM v
ORDER BY v.run_id, v.policy_version
