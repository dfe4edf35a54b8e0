"""`offline-rec demo`: the whole loop on a built-in arith task with a shipped tiny policy (package data)."""
