"""Environments shipped in code: verifiable tasks a producer runs against the policy (no downloads).

`digits`: the digit task, its vocabulary and resumable prompt streams; `episode`: one
multi-turn attempt as an I/O-free state machine that turns into the push API's samples.
"""
