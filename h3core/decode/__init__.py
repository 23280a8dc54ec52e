"""Video and sound out: H3's two VAEs (diffusers' classes, loaded from any of their checkpoint
layouts), the mp4 (PyAV), and the memory a decode needs.

Modules, lowest first: `geometry` (frames, latents, samples: torch-free), `memory` (the estimate:
torch-free), `report`, `vae_files` (which files, which VAE, which key layout), `video_vae` /
`audio_vae` (each VAE's layouts and structure), `load` (into diffusers' classes), `synthetic`
(the embedded small VAEs), `sources` (flag > variable > beside the transformer > synthetic),
`mp4` (encode and probe), `run` (`decode_to_folder`, `Decoders`), `command` (`h3 decode`).

Importing this package is cheap: torch, diffusers and PyAV load when a decode starts.
"""
