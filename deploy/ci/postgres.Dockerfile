# PostgreSQL from Debian bookworm's packages (bookworm ships 15; the user-facing stack runs postgres:17 from Docker
# Hub, which the CI machines cannot reach), on the same local DEBIAN_IMAGE as deploy/ci/python.Dockerfile. It takes
# the postgres image's variables (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB) and data folder.

ARG DEBIAN_IMAGE=clawgate-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql

COPY postgres-start.sh /usr/local/bin/postgres-start.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
CMD ["sh", "/usr/local/bin/postgres-start.sh"]
