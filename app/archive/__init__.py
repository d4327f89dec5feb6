"""The archive of records that left the live window (SSTD §3.2): Parquet files under
`archive_url`, written by the workers (`app.archive.writer`) and read by the query runner."""
