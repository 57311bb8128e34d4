-- Infra-failure and retry rates by cause, per run.
--
-- Answers: how often does work fail or get redone for reasons that are not the
-- policy's fault, and why?
--   kind = infra_failure (trajectories table): a trajectory without a valid
--     evaluation (status INFRA_FAILED or EXPIRED, verdict ENV_ERROR or UNKNOWN,
--     or reward null); cause = 'status/verdict/stop_reason' of the trajectory,
--     e.g. 'INFRA_FAILED/ENV_ERROR/env_timeout'. Denominator: the run's trajectories.
--   kind = retry (events table), denominator: the run's episodes:
--     cause 'resumed_episode'     an episode whose events come from more than one
--                                 worker_id (a worker died and another resumed it);
--     cause 'unconfirmed_action'  an ACTION_COMMITTED with no ACTION_EXECUTED for the
--                                 same (episode_id, step_id, action_id): a tool call
--                                 interrupted or never confirmed;
--     cause 'repeated_generation' / 'repeated_verification'  more than one GENERATING
--                                 (VERIFYING) event for one (episode_id, step_id):
--                                 the extra ones are counted.
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, kind, cause
--   n            failures / retries of this cause
--   denominator  trajectories (infra_failure) or episodes (retry) of the run
--   rate         n / denominator
WITH t AS (
    SELECT run_id, status, verdict, stop_reason, reward FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
t_total AS (SELECT run_id, count(*) AS d FROM t GROUP BY run_id),
infra AS (
    SELECT run_id, 'infra_failure' AS kind, status || '/' || verdict || '/' || stop_reason AS cause, count(*) AS n
    FROM t
    WHERE status IN ('INFRA_FAILED', 'EXPIRED') OR verdict IN ('ENV_ERROR', 'UNKNOWN') OR reward IS NULL
    GROUP BY ALL
),
e AS (
    SELECT run_id, episode_id, step_id, action_id, event_type, worker_id FROM events
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
e_total AS (SELECT run_id, count(DISTINCT episode_id) AS d FROM e GROUP BY run_id),
resumed AS (
    SELECT run_id, 'retry' AS kind, 'resumed_episode' AS cause, count(*) AS n
    FROM (SELECT run_id, episode_id FROM e GROUP BY run_id, episode_id HAVING count(DISTINCT worker_id) > 1)
    GROUP BY run_id
),
unconfirmed AS (
    SELECT c.run_id, 'retry' AS kind, 'unconfirmed_action' AS cause, count(*) AS n
    FROM e AS c
    ANTI JOIN (SELECT episode_id, step_id, action_id FROM e WHERE event_type = 'ACTION_EXECUTED') AS x
        ON c.episode_id = x.episode_id AND c.step_id = x.step_id AND c.action_id = x.action_id
    WHERE c.event_type = 'ACTION_COMMITTED'
    GROUP BY c.run_id
),
repeated AS (
    SELECT run_id, 'retry' AS kind,
           CASE event_type WHEN 'GENERATING' THEN 'repeated_generation' ELSE 'repeated_verification' END AS cause,
           sum(k - 1)::BIGINT AS n
    FROM (SELECT run_id, episode_id, step_id, event_type, count(*) AS k FROM e
          WHERE event_type IN ('GENERATING', 'VERIFYING')
          GROUP BY ALL HAVING count(*) > 1)
    GROUP BY ALL
)
SELECT i.run_id, i.kind, i.cause, i.n, tt.d AS denominator, i.n / tt.d AS rate
FROM infra AS i JOIN t_total AS tt USING (run_id)
UNION ALL
SELECT r.run_id, r.kind, r.cause, r.n, et.d AS denominator, r.n / et.d AS rate
FROM (SELECT * FROM resumed UNION ALL SELECT * FROM unconfirmed UNION ALL SELECT * FROM repeated) AS r
JOIN e_total AS et USING (run_id)
ORDER BY run_id, kind, n DESC, cause
