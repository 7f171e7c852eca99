package jsonscan

import "unsafe"

// String is b as a string, without a copy: it shares b's memory, so it is
// valid only while b is and b does not change. Read it (compare, parse,
// look a path up in it) and drop it; keep a copy (strings.Clone) of
// anything that must outlive b. It is how the relay reads a request's or
// an answer's JSON in place, with the scanner and with gjson.
func String(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }
