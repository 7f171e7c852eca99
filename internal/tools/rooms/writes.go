package main

import (
	"go/ast"
	"go/token"
	"go/types"
)

// Write is one place that writes a field of a struct type: an assignment,
// an increment, or the taking of the field's address (a write through the
// pointer cannot be told from a read).
type Write struct {
	// File and Line are where.
	File string
	Line int
	// Field is the field written, as Type.field.
	Field string
}

// Writes lists the places in the package that write a field of the named
// struct type, directly (in.end.status = 200) or a field inside it
// (in.end.usage.input = 5), or the whole value (in.end = ending{}).
func (h *House) Writes(typeName string) []Write {
	obj, _ := h.Types.Scope().Lookup(typeName).(*types.TypeName)
	if obj == nil {
		return nil
	}
	named, _ := obj.Type().(*types.Named)
	var out []Write
	// local reports whether e names a variable of the function it is in
	// that holds a value of its own (not a pointer): writing its fields
	// makes a new value, and writes no one else's
	local := func(e ast.Expr) bool {
		id, ok := e.(*ast.Ident)
		if !ok {
			return false
		}
		v, ok := h.Info.Uses[id].(*types.Var)
		if !ok || v.IsField() || v.Parent() == nil || v.Parent() == h.Types.Scope() {
			return false
		}
		_, ptr := v.Type().(*types.Pointer)
		return !ptr
	}
	// written reports the first selector in e's chain that selects a field
	// of the type, or whose value is of the type
	var written func(e ast.Expr) (string, bool)
	written = func(e ast.Expr) (string, bool) {
		switch x := e.(type) {
		case *ast.ParenExpr:
			return written(x.X)
		case *ast.IndexExpr:
			return written(x.X)
		case *ast.StarExpr:
			return written(x.X)
		case *ast.SelectorExpr:
			if sel := h.Info.Selections[x]; sel != nil && sel.Kind() == types.FieldVal {
				if recv := deref(sel.Recv()); types.Identical(recv, named) {
					if local(x.X) {
						return "", false // a value of its own being made
					}
					return typeName + "." + x.Sel.Name, true
				}
				if types.Identical(deref(sel.Obj().Type()), named) {
					return typeName, true
				}
				if _, ptr := h.Info.Types[x.X].Type.(*types.Pointer); ptr {
					return "", false // through a pointer: what is written is elsewhere
				}
			}
			return written(x.X)
		}
		return "", false
	}
	// compared are the &x of a comparison of addresses, which read
	compared := map[ast.Expr]bool{}
	note := func(e ast.Expr, at token.Pos) {
		if f, ok := written(e); ok {
			p := h.Fset.Position(at)
			out = append(out, Write{File: base(h.Fset, at), Line: p.Line, Field: f})
		}
	}
	for _, f := range h.Syntax {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.AssignStmt:
				for _, l := range n.Lhs {
					note(l, l.Pos())
				}
			case *ast.IncDecStmt:
				note(n.X, n.Pos())
			case *ast.BinaryExpr:
				if n.Op == token.EQL || n.Op == token.NEQ {
					compared[n.X], compared[n.Y] = true, true
				}
			case *ast.UnaryExpr:
				if n.Op == token.AND && !compared[n] {
					note(n.X, n.Pos())
				}
			case *ast.CallExpr:
				// x.f.m() with m on *T takes &x.f: a write
				if fun, ok := n.Fun.(*ast.SelectorExpr); ok {
					if sel := h.Info.Selections[fun]; sel != nil && sel.Kind() == types.MethodVal {
						recv := sel.Obj().Type().(*types.Signature).Recv().Type()
						_, ptrRecv := recv.(*types.Pointer)
						_, ptrVal := h.Info.Types[fun.X].Type.(*types.Pointer)
						// the type's own methods are how it is written;
						// an atomic's Load reads
						atomicRead := sel.Obj().Pkg() != nil && sel.Obj().Pkg().Path() == "sync/atomic" && sel.Obj().Name() == "Load"
						if ptrRecv && !ptrVal && !atomicRead && !types.Identical(deref(recv), named) {
							note(fun.X, n.Pos())
						}
					}
				}
			case *ast.CompositeLit:
				// a value made whole: T{...} or &T{...}
				if tv, ok := h.Info.Types[n]; ok && types.Identical(deref(tv.Type), named) {
					p := h.Fset.Position(n.Pos())
					out = append(out, Write{File: base(h.Fset, n.Pos()), Line: p.Line, Field: typeName + "{}"})
				}
			}
			return true
		})
	}
	return out
}

func deref(t types.Type) types.Type {
	if p, ok := t.(*types.Pointer); ok {
		return p.Elem()
	}
	return t
}
