"""The loss of offline-rec: ratios, per-token terms, aggregation, advantages, the objective, its presets."""
