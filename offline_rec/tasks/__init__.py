"""Tasks: prompts and reward functions (built-in arith, GSM8K, MATH, or a module:function), run with timeouts."""
