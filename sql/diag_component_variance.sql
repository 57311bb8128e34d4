-- Diagnostics: within-group variance of each reward component, tagged fact or heuristic by the environment.
--
-- Answers: which reward components carry the group-relative signal? GRPO
-- ranks the members of a group by reward, so a component that varies within
-- groups drives the update. A heuristic (shaping) component whose
-- within-group variance rivals or beats the fact components' is the
-- reward-hacking signature: groups are being ranked by the shaping term, not
-- by the task. Valid members as in quality.sql (not INFRA_FAILED/EXPIRED,
-- verdict PASS/FAIL, reward not null); groups where at least 2 valid members
-- report the component. The tag comes from the environment's declaration
-- (view component_tags, built from the registered environments'
-- component_tags, joined on env_version; untagged when none is declared).
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
--
-- Columns:
--   run_id
--   env_version      the group's environment (the smallest, if its members differ)
--   component        key of reward_components
--   tag              fact | heuristic | untagged
--   groups           groups with >= 2 valid members reporting the component
--   mean_within_var  mean over those groups of the component's population variance within the group
--   varying_groups   groups in which the component varies (max > min)
--   varying_share    varying_groups / groups
WITH kv AS (
    SELECT run_id, group_id, env_version, unnest(map_entries(reward_components)) AS e
    FROM trajectories
    WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
      AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
      AND reward_components IS NOT NULL
),
g AS (
    SELECT run_id, group_id, min(env_version) AS env_version, e.key AS component,
           var_pop(e.value) AS v, max(e.value) > min(e.value) AS varies
    FROM kv
    GROUP BY run_id, group_id, e.key
    HAVING count(e.value) >= 2
)
SELECT
    g.run_id,
    g.env_version,
    g.component,
    coalesce(any_value(t.tag), 'untagged') AS tag,
    count(*) AS groups,
    avg(g.v) AS mean_within_var,
    count(*) FILTER (WHERE g.varies) AS varying_groups,
    count(*) FILTER (WHERE g.varies) / count(*) AS varying_share
FROM g
LEFT JOIN component_tags AS t ON t.env_version = g.env_version AND t.component = g.component
GROUP BY g.run_id, g.env_version, g.component
ORDER BY g.run_id, g.env_version, g.component
