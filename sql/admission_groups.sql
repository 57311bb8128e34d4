-- Admission, group checks: arrival, valid members, reward spread, reward-decomposition gates (one row per ready group).
--
-- Input view: members (the output of admission_members.sql; reason NULL = valid).
-- Zero variance is tested exactly as max(reward) > min(reward) over valid
-- members, then min_reward_std on the population std (engines' variance
-- functions return 1e-9..1e-8 for equal rewards; docs/dependency-notes.md).
-- The decision itself (first failing blocking check) is made from these
-- columns by pipeline/admission/checks.py, identically for every engine.
-- run_id / task_id are those of the group's smallest trajectory_id. Unordered: the caller sorts.
-- @param min_valid_members = 2
-- @param min_reward_std = 1e-6
SELECT group_id,
       arg_min(run_id, trajectory_id) AS run_id,
       arg_min(task_id, trajectory_id) AS task_id,
       min(difficulty) AS difficulty,
       any_value(ref_policy_version) AS ref_policy_version,
       any_value(ref_tokenizer_rev) AS ref_tokenizer_rev,
       any_value(ref_prompt_template_rev) AS ref_prompt_template_rev,
       any_value(ref_env_version) AS ref_env_version,
       any_value(ref_verifier_version) AS ref_verifier_version,
       any_value(ref_temperature) AS ref_temperature,
       any_value(ref_top_p) AS ref_top_p,
       any_value(ref_task_version) AS ref_task_version,
       any_value(ref_harness_version) AS ref_harness_version,
       any_value(ref_tool_schema_version) AS ref_tool_schema_version,
       any_value(ref_prompt_hash) AS ref_prompt_hash,
       any_value(ref_env_state_hash) AS ref_env_state_hash,
       CAST(max(group_size) AS INTEGER) AS group_size,
       CAST(count(*) AS INTEGER) AS arrived_members,
       max(response_len) AS max_response_len,
       max(num_tool_calls) AS max_tool_calls,
       CAST(count(*) FILTER (WHERE reason IS NULL) AS INTEGER) AS n_valid,
       count(*) FILTER (WHERE reason IS NULL) >= $min_valid_members AS min_valid_ok,
       coalesce(max(reward) FILTER (WHERE reason IS NULL) > min(reward) FILTER (WHERE reason IS NULL)
                AND stddev_pop(reward) FILTER (WHERE reason IS NULL) >= $min_reward_std, false) AS spread_ok,
       max(policy_lag) FILTER (WHERE reason IS NULL) AS policy_lag,
       max(queue_wait_ms) FILTER (WHERE reason IS NULL) AS max_queue_wait_ms
       /*GATES*/
FROM members
GROUP BY group_id
