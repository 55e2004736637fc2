"""Fault injection: prove exactly-once under crashes, restarts and hostile input (`txbox chaos`)."""
