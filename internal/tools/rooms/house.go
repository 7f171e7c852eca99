package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// File is one source file of the measured package.
type File struct {
	// Name is the file's base name.
	Name string
	// Lines is its count of lines.
	Lines int
	// Uses are the other files of the package that define a name this one
	// uses, sorted.
	Uses []string
	// Imports are the import paths the file names.
	Imports []string
}

// House is one package, measured.
type House struct {
	// Path is the package's import path.
	Path string
	// Dir is its folder.
	Dir string
	// Files are its source files (tests left out), by name.
	Files []File
	// Fset and Syntax are the parsed files, for checks that read the code.
	Fset   *token.FileSet
	Syntax []*ast.File
	// Info is go/types' record of the package.
	Info *types.Info
	// Types is the checked package.
	Types *types.Package
}

type listed struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Export     string
}

// Measure type-checks the package in dir and records which file uses which.
func Measure(dir string) (*House, error) {
	cmd := exec.Command("go", "list", "-deps", "-export", "-json=ImportPath,Dir,GoFiles,Export", ".")
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %v: %s", err, stderr.String())
	}
	exports := map[string]string{}
	var self listed
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p listed
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			return nil, err
		}
		exports[p.ImportPath] = p.Export
		self = p // the package itself comes last
	}
	fset := token.NewFileSet()
	h := &House{Path: self.ImportPath, Dir: self.Dir, Fset: fset}
	for _, name := range self.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(self.Dir, name), nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		h.Syntax = append(h.Syntax, f)
	}
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok || file == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(file)
	})
	h.Info = &types.Info{Uses: map[*ast.Ident]types.Object{}, Defs: map[*ast.Ident]types.Object{}, Selections: map[*ast.SelectorExpr]*types.Selection{}, Types: map[ast.Expr]types.TypeAndValue{}}
	conf := types.Config{Importer: imp}
	h.Types, err = conf.Check(self.ImportPath, fset, h.Syntax, h.Info)
	if err != nil {
		return nil, err
	}
	uses := make(map[string]map[string]bool)
	for _, f := range h.Syntax {
		uses[base(fset, f.Pos())] = map[string]bool{}
	}
	note := func(at token.Pos, obj types.Object) {
		if obj == nil || obj.Pkg() != h.Types || !obj.Pos().IsValid() {
			return
		}
		if v, ok := obj.(*types.Var); ok && !v.IsField() && obj.Parent() != h.Types.Scope() {
			return // a local variable
		}
		if _, ok := obj.(*types.Label); ok {
			return
		}
		if obj.Parent() != nil && obj.Parent() != h.Types.Scope() && obj.Parent() != types.Universe {
			if _, isVar := obj.(*types.Var); !isVar {
				return // a local type or constant
			}
		}
		from, to := base(fset, at), base(fset, obj.Pos())
		if from != to {
			uses[from][to] = true
		}
	}
	for id, obj := range h.Info.Uses {
		note(id.Pos(), obj)
	}
	for sel, s := range h.Info.Selections {
		note(sel.Sel.Pos(), s.Obj())
	}
	for _, f := range h.Syntax {
		name := base(fset, f.Pos())
		file := File{Name: name, Lines: fset.File(f.Pos()).LineCount()}
		for to := range uses[name] {
			file.Uses = append(file.Uses, to)
		}
		slices.Sort(file.Uses)
		for _, is := range f.Imports {
			file.Imports = append(file.Imports, strings.Trim(is.Path.Value, `"`))
		}
		h.Files = append(h.Files, file)
	}
	slices.SortFunc(h.Files, func(a, b File) int { return strings.Compare(a.Name, b.Name) })
	return h, nil
}

func base(fset *token.FileSet, p token.Pos) string { return filepath.Base(fset.Position(p).Filename) }

// Lines is the package's lines of source, tests left out.
func (h *House) Lines() int {
	n := 0
	for _, f := range h.Files {
		n += f.Lines
	}
	return n
}

// Largest is the file with the most lines.
func (h *House) Largest() File {
	var big File
	for _, f := range h.Files {
		if f.Lines > big.Lines {
			big = f
		}
	}
	return big
}

// UsedBy lists the files that use a name the named file defines.
func (h *House) UsedBy(name string) []string {
	var by []string
	for _, f := range h.Files {
		if slices.Contains(f.Uses, name) {
			by = append(by, f.Name)
		}
	}
	return by
}

// LargestCircle is the largest strongly connected set of files under
// "uses": every file in it reaches every other through uses. It is found
// with Tarjan's algorithm.
func (h *House) LargestCircle() []string {
	index := map[string]int{}
	low := map[string]int{}
	on := map[string]bool{}
	var stack, best []string
	next := 0
	edges := map[string][]string{}
	for _, f := range h.Files {
		edges[f.Name] = f.Uses
	}
	var visit func(v string)
	visit = func(v string) {
		index[v], low[v] = next, next
		next++
		stack = append(stack, v)
		on[v] = true
		for _, w := range edges[v] {
			if _, seen := index[w]; !seen {
				visit(w)
				low[v] = min(low[v], low[w])
			} else if on[w] {
				low[v] = min(low[v], index[w])
			}
		}
		if low[v] == index[v] {
			var scc []string
			for {
				w := stack[len(stack)-1]
				stack = stack[:len(stack)-1]
				on[w] = false
				scc = append(scc, w)
				if w == v {
					break
				}
			}
			if len(scc) > len(best) {
				best = scc
			}
		}
	}
	for _, f := range h.Files {
		if _, seen := index[f.Name]; !seen {
			visit(f.Name)
		}
	}
	slices.Sort(best)
	return best
}
