// Package ledger keeps the relay's usage ledger: one row per request in a
// database that finance can query, SQLite (a file of this machine) or
// Postgres (a fleet's). It holds the storage, the writer that takes rows
// off the request path in batches (a bounded queue, one writer per
// database in a process, kept across config reloads), the schema and its
// migrations, the daily rollup, and the usage queries and their answer in
// JSON or CSV (GET /relay/usage, the status page's Spend view).
//
// It knows nothing of requests: the relay builds each request's Row from
// what the request noted and hands it to the Writer of its config (Load).
package ledger
