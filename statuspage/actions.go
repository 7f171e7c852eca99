package statuspage

import (
	"encoding/json"
	"net/http"
	"net/url"
)

// act steers a channel as the admin API's POST does, for a POST from the
// page's own origin only.
func (s *StatusPage) act(w http.ResponseWriter, r *http.Request, name, action string) error {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		return statusError(w, http.StatusMethodNotAllowed, "use POST")
	}
	if !s.trustedHost(r) {
		return statusError(w, http.StatusForbidden, errUntrustedHost)
	}
	if !sameOrigin(r) {
		return statusError(w, http.StatusForbidden, "cross-origin request refused")
	}
	name, err := url.PathUnescape(name)
	if err != nil {
		return statusError(w, http.StatusBadRequest, "bad channel name")
	}
	st, err := s.src.Act(name, action)
	if err != nil {
		return statusError(w, http.StatusNotFound, err.Error())
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(st)
}
