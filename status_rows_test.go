package relay

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/caddy-relay/relay/statuspage"
)

// fillAll sets every field of the value v points to, nested ones
// included, to a value that is not its zero, so that JSON shows each.
func fillAll(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fillAll(v.Elem())
	case reflect.Struct:
		if v.Type() == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)))
			return
		}
		for i := range v.NumField() {
			if f := v.Type().Field(i); f.IsExported() || f.Anonymous {
				fillAll(v.Field(i))
			}
		}
	case reflect.String:
		v.SetString("s")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int64, reflect.Int32:
		v.SetInt(7)
	case reflect.Uint64, reflect.Uint:
		v.SetUint(8)
	case reflect.Float64:
		v.SetFloat(1.5)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fillAll(v.Index(0))
	case reflect.Map:
		v.Set(reflect.MakeMap(v.Type()))
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fillAll(k)
		fillAll(e)
		v.SetMapIndex(k, e)
	}
}

// filled is a T with every field set.
func filled[T any]() T {
	var v T
	fillAll(reflect.ValueOf(&v).Elem())
	return v
}

// TestStatusRowsAreTheAdminRows: the rows the status page shows of a
// channel, a key, a session and a fleet node are the admin API's rows,
// byte for byte in JSON: a field added to an admin row and not to the
// page's fails here.
func TestStatusRowsAreTheAdminRows(t *testing.T) {
	same := func(what string, admin, page any) {
		t.Helper()
		a, err := json.Marshal(admin)
		if err != nil {
			t.Fatal(err)
		}
		p, err := json.Marshal(page)
		if err != nil {
			t.Fatal(err)
		}
		if string(a) != string(p) {
			t.Errorf("the page's %s is not the admin API's:\nadmin %s\npage  %s", what, a, p)
		}
	}
	ch := filled[channelStatus]()
	same("channel", ch, pageChannel(ch))
	k := filled[keyStatus]()
	same("key", k, pageKey(k))
	s := filled[sessionView]()
	same("session", s, statuspage.Session(s))

	// in the page's state, a channel's row is followed by its recent traffic
	view, _ := json.Marshal(statuspage.ChannelView{Channel: pageChannel(ch)})
	a, _ := json.Marshal(ch)
	if want := string(a[:len(a)-1]) + `,"recent":`; len(view) < len(want) || string(view[:len(want)]) != want {
		t.Errorf("the page's channel view:\n%s", view)
	}
}
