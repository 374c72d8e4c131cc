"""Pure math on arrays: advantages, policy-gradient losses, KL estimators, aggregation."""
