// Package money keeps what requests cost and what may be spent: the price
// table (Price, Pricebook: the built-in list under the configured rows,
// and the estimate of a model it does not know), what server tools may
// cost, and the accounts of spend, their budgets and the holds of the
// requests in flight against them, alone or shared by a fleet.
//
// The package never reads a request: callers hand it what a request used
// (Usage), the models and amounts it holds, and the accounts it is
// charged to.
package money
