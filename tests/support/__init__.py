"""Code the tests share: spawning ranks (``ranks``), the KDA parity cases and their rank-side code
(``kda_cases``), `skyrl-kda run` as a subprocess (``cli_runs``) and the training runs on spawned
meshes (``mesh_runs``). Fixtures live in ``tests/conftest.py``."""
