package ledger

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"
)

func TestUSDDecimalIsExact(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 1: "0.000000001", 1_500_000_000: "1.5", 123_456_789_012: "123.456789012", -2_000_000_000: "-2"} {
		if got := usdDecimal(n); got != want {
			t.Errorf("usdDecimal(%d) = %q, want %q", n, got, want)
		}
	}
}

// brokenUsageStore answers a usage query with one row, then fails.
type brokenUsageStore struct{ *flakyStore }

func (brokenUsageStore) Usage(_ context.Context, _ Query, emit func(UsageRow) error) error {
	if err := emit(UsageRow{Values: []string{"k"}, Requests: 1}); err != nil {
		return err
	}
	return errors.New("the database went away")
}

// A usage answer that fails after it began is cut, not ended as if whole:
// a CSV without its last rows would look like a complete invoice.
func TestAUsageAnswerThatFailsMidwayIsCut(t *testing.T) {
	l := newWriter(brokenUsageStore{new(flakyStore)}, "test", zap.NewNop(), Queue)
	for _, csv := range []bool{true, false} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_ = WriteUsage(w, r, l, Query{GroupBy: []string{"key"}, CSV: csv})
		}))
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		if resp.StatusCode != http.StatusOK || err == nil {
			t.Errorf("csv %v: status %d, body %q read with error %v: want the answer cut before its end", csv, resp.StatusCode, body, err)
		}
		if !strings.Contains(string(body), "k") {
			t.Errorf("csv %v: the rows before the failure did not arrive: %q", csv, body)
		}
	}
}

// A spreadsheet reads a cell that begins with =, +, -, @, a tab or a
// carriage return as a formula: a CSV cell of a name begins with a ' then,
// and reads as the text it is.
func TestCSVCellsOfNamesNeverReadAsFormulas(t *testing.T) {
	for in, want := range map[string]string{
		`=HYPERLINK("http://evil.example/","x")`: `'=HYPERLINK("http://evil.example/","x")`,
		"+1+1":                                   "'+1+1",
		"-2+3":                                   "'-2+3",
		"@SUM(A1:A9)":                            "'@SUM(A1:A9)",
		"\t=1":                                   "'\t=1",
		"\r=1":                                   "'\r=1",
		"":                                       "",
		"alice":                                  "alice",
		"a=b":                                    "a=b",
		"'=already":                              "'=already",
		" =spaced":                               " =spaced",
		"2026-03-01":                             "2026-03-01",
		"claude-opus-4":                          "claude-opus-4",
	} {
		if got := csvCell(in); got != want {
			t.Errorf("csvCell(%q) = %q, want %q", in, got, want)
		}
	}
}
