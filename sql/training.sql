-- Training metrics per optimizer step across checkpoints: loss, reward, KL, entropy, clipping, throughput, policy lag.
--
-- Answers: how did each training run behave, step by step, in the order the
-- checkpoints were published? From the metrics table (one row per optimizer
-- step, written by pipeline train) joined to checkpoints for the policy
-- version each run produced. global_step restarts at 0 in every run; step
-- numbers the rows across runs (ordered by policy_version, checkpoint
-- created_at, checkpoint_id, global_step; runs whose checkpoint row is missing
-- come last).
--
-- Parameters:
-- @param checkpoint_id = NULL   one checkpoint's run (NULL: every run)
--
-- Columns:
--   step                 0-based position across runs
--   checkpoint_id, policy_version (produced by the run), global_step, epoch
--   loss, pg_loss, reward_mean, advantage_mean, kl, approx_kl, entropy
--   clip_fraction, grad_norm, lr, tokens_per_s, padding_ratio, policy_lag, policy_lag_max, created_at
--   clip_frac_high, clip_frac_low          clipped above (ratio > 1 + clip_high) / below (ratio < 1 - clip_low)
--   ratio_p05, ratio_p50, ratio_p95        importance-ratio quantiles
--   mismatch_kl                            KL between rollout-engine and trainer log-probs (engine drift)
--   ess_token_frac, ess_seq_frac           importance-sampling ESS / n of the step's policy against the
--                                          rollout's sampling log-probs, token- and sequence-level
--   behav_ratio_p50, behav_ratio_p90, behav_ratio_p99, behav_ratio_max
--                                          token ratio pi / mu quantiles against the sampling log-probs
--   behav_ratio_above                      share of tokens with pi / mu above ratio_tail_bound
--                                          (these seven: null in rows written before they were recorded)
--   step_seconds, tokens, sequences
--   elapsed_s        seconds since the run's first step finished (wall-time x axis)
--   samples          trajectories trained on so far in the run (samples x axis)
SELECT
    row_number() OVER (ORDER BY c.policy_version NULLS LAST, c.created_at NULLS LAST, m.checkpoint_id, m.global_step)
        - 1 AS step,
    m.checkpoint_id,
    c.policy_version,
    m.global_step,
    m.epoch,
    m.loss, m.pg_loss, m.reward_mean, m.advantage_mean, m.kl, m.approx_kl, m.entropy,
    m.clip_fraction, m.grad_norm, m.lr, m.tokens_per_s, m.padding_ratio, m.policy_lag, m.policy_lag_max,
    m.created_at,
    m.clip_frac_high, m.clip_frac_low, m.ratio_p05, m.ratio_p50, m.ratio_p95, m.mismatch_kl,
    m.step_seconds, m.tokens, m.sequences,
    m.ess_token_frac, m.ess_seq_frac, m.behav_ratio_p50, m.behav_ratio_p90, m.behav_ratio_p99, m.behav_ratio_max,
    m.behav_ratio_above,
    epoch(m.created_at) - min(epoch(m.created_at)) OVER (PARTITION BY m.checkpoint_id) AS elapsed_s,
    sum(m.sequences) OVER (PARTITION BY m.checkpoint_id ORDER BY m.global_step) AS samples
FROM metrics AS m
LEFT JOIN checkpoints AS c USING (checkpoint_id)
WHERE $checkpoint_id::VARCHAR IS NULL OR m.checkpoint_id = $checkpoint_id::VARCHAR
ORDER BY step
