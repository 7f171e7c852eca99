package relay

import (
	"net/http"
	"time"
)

// answerRecorder is the one exit every answer leaves by. ServeHTTP
// installs it over the client's writer before anything else runs, so
// whatever writes the answer (an attempt's commit, a stream, the relay's own error, a
// cached or a shared answer, the models list, a resource call, the Chat
// Completions writer) goes through it, and it records for the request's
// account what the client got: the status and when its first byte went.
// Nothing else sets them. It lives in the request's record: installing it
// allocates nothing.
type answerRecorder struct {
	http.ResponseWriter
	in *inbound
}

// install puts the recorder of in over w and returns it as the writer the
// request is to use.
func (rec *answerRecorder) install(w http.ResponseWriter, in *inbound) http.ResponseWriter {
	rec.ResponseWriter, rec.in = w, in
	return rec
}

// WriteHeader implements http.ResponseWriter: the first final status is
// the request's (an informational 1xx is not).
func (rec *answerRecorder) WriteHeader(status int) {
	rec.see(status)
	rec.ResponseWriter.WriteHeader(status)
}

// Write implements http.ResponseWriter: a body written without a status
// is a 200's, as net/http sends it.
func (rec *answerRecorder) Write(p []byte) (int, error) {
	rec.see(http.StatusOK)
	return rec.ResponseWriter.Write(p)
}

// see records status, unless the request has its status already.
func (rec *answerRecorder) see(status int) {
	if in := rec.in; in.end.status == 0 && status >= 200 {
		in.end.sent(status, time.Since(in.start))
		in.budgetHeader(rec.ResponseWriter.Header()) // before the first byte, whoever writes the answer
	}
}

// Unwrap lets http.ResponseController reach the writer below (flushes,
// deadlines).
func (rec *answerRecorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }
