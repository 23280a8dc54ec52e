"""Reports: what every command writes and prints, in one vocabulary.

- `outputs`  where results go: checked before any rank starts, staged privately, published whole
- `schema`   what every report shares: versions, latent checksums, the one error metric, timestamps,
             and the one way from a report to an exit code (`Verdict`)
- `units`    the one byte formatter
- `preview`  a PNG look at a video latent
"""
