"""Launchers that start jaxrl on machines other than this one (standard library only).

`launchers.tpu_pod` (`python -m launchers.tpu_pod`, or the `jaxrl-tpu` console script): a Cloud TPU pod
through `gcloud` (create / queued resources, sync, run on every host with fail-fast, delete).
"""
