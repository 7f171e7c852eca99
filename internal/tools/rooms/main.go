// Command rooms measures how a Go package's files lean on each other: for
// each source file (tests left out), which other files of the same package
// define a name it uses (a function, type, variable, constant, method or
// field), by go/types. It prints the package's files and lines, the largest
// circle (the largest set of files that all reach each other through such
// uses), and the files most used.
//
//	go run ./internal/tools/rooms [-v] [package dir]
//
// It runs `go list` for the export data of the package's imports, so it
// sees the build the go command would make on this machine.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

func main() {
	verbose := flag.Bool("v", false, "list every file of the largest circle and every file's uses")
	writes := flag.String("writes", "", "list the places that write a field of this struct type, and stop")
	flag.Parse()
	dir := "."
	if flag.NArg() > 0 {
		dir = flag.Arg(0)
	}
	h, err := Measure(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "rooms:", err)
		os.Exit(1)
	}
	if *writes != "" {
		for _, w := range h.Writes(*writes) {
			fmt.Printf("%s:%d %s\n", w.File, w.Line, w.Field)
		}
		return
	}
	circle := h.LargestCircle()
	fmt.Printf("package %s: %d source files, %d lines\n", h.Path, len(h.Files), h.Lines())
	fmt.Printf("largest circle: %d of %d files reach each other\n", len(circle), len(h.Files))
	fmt.Printf("largest file: %s, %d lines\n", h.Largest().Name, h.Largest().Lines)
	type use struct {
		name string
		by   int
	}
	var uses []use
	for _, f := range h.Files {
		uses = append(uses, use{f.Name, len(h.UsedBy(f.Name))})
	}
	slices.SortFunc(uses, func(a, b use) int { return b.by - a.by })
	fmt.Print("most used:")
	for _, u := range uses[:min(5, len(uses))] {
		fmt.Printf(" %s by %d,", u.name, u.by)
	}
	fmt.Println()
	if *verbose {
		fmt.Println("the circle:")
		for _, f := range circle {
			fmt.Println("  ", f)
		}
		for _, f := range h.Files {
			fmt.Printf("%s (%d lines) uses %v\n", filepath.Base(f.Name), f.Lines, f.Uses)
		}
	}
}
