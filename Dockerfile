# The operator image: `epd-operator run ...` (see charts/epd-operator for how it is deployed).
#
#   docker build -t epd-operator:0.1.0 .
#
# Two stages so the image carries the installed venv only, not the sources or pip's caches.
# tests/helm/test_dockerfile.py runs this file's install step for real and checks the result.
#
# BASE: any Debian-like image with Python 3.11 on PATH as `python`. `make images` builds one
# from Debian's packages (no registry reachable there) and passes it here.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the install needs (pyproject's readme is optional for building the wheel).
COPY pyproject.toml ./
COPY operator ./operator
# No test extras: runtime dependencies only. Not editable: the venv must not point at /src.
RUN python -m venv /opt/epd-operator \
    && /opt/epd-operator/bin/pip install --no-cache-dir /src

FROM ${BASE}
# The venv's python is a symlink to the base's python3.11, present in both stages.
COPY --from=build /opt/epd-operator /opt/epd-operator
ENV PATH=/opt/epd-operator/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# 65532 is the conventional "nonroot" uid/gid (distroless); the chart runs the pod with it too
# and with a read-only root filesystem, so nothing below may need to write outside /tmp.
USER 65532:65532
ENTRYPOINT ["epd-operator"]
CMD ["run", "--all-namespaces", "--standalone"]
